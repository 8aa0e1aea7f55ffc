"""FedAMoLE (paper 002): adaptive mixture of LoRA experts with reverse-selection expert assignment.

Per round (docs/methods.md 1.6 order): each client receives its assigned domain experts per module, the
shared expert and the token projections; trains them with AMoLE routing and the load-balance loss
(NLL + 0.001 * sum over modules of the Switch loss, 1.3, over the real tokens: padding is left out, as
the reference's batch-1 sequences have none); then embeds its embedding set (5 % of its
data, at most 200 examples) to upload the client embedding and its experts' embeddings (1.4). The
server averages the token projections and the shared expert over all clients and each domain expert
over its holders (1.6), scores relevance between server expert embeddings and client embeddings, and
solves the assignment MILP (1.5) for the next round; round 0 uses random scores. The embeddings thus
ride in the training upload (``emb.*`` keys) and the next dispatch is computed from them, as in the
reference loop, so one message per client per round suffices (each client's differs).

Options (``--option KEY=VALUE``; unknown keys are refused) cover the paper's ablations (section 5.5):
``assignment=static`` (FedMoLE: random at round 0, then fixed), ``assignment=random`` (FedAMoLE-R),
``shared_expert=false`` (FedAMoLE-S), ``homogeneous=true`` (the reference's ``--homo_arch``) and
``router=vanilla`` (FedAMoLE-A: a vanilla MoLE router, one linear layer over all N_e experts per module
in place of the token projection, averaged like it; tokens take the top-k of the client's assigned
experts by its logits, as the paper describes; RSEA then scores expert j for client i by the router's
mean logit for j over the client's embedding set, our reading where the paper gives no formula, since
eq. (17) needs the token projection the ablation removes). Uploaded embeddings can be protected
(Appendix C.2) with ``embed_noise=<sigma>`` (Gaussian) or ``dp_noise=true`` (the reference's
mechanism, rate ``dp_eta``), drawn from (seed, round, client) so training itself is unchanged.

The exported model (``export``): ``local`` (default) writes, besides the server's pool, each client's
last-round locally trained experts, shared expert and token projections before aggregation
(``adapters/clients/<id>/amole``): paper App. D.1.1 scores "client i's local model at round R", and the
reference code measures MTAL on each client's model right after local training (docs/methods.md 1.9);
``aggregated`` writes only the server's pool after the last aggregation (one servable folder).

The expert pool scales with the clients: ``num_experts`` defaults to 3 per client in the simulator
(:data:`EXPERTS_PER_CLIENT`), so each client holds ``3 * k_c = 6`` experts per module on average, the
paper's 30 experts over 10 clients (24 for FedDPA's 8; 30 over 8 would leave RSEA little freedom under the
8-per-client cap); the Flower runtime and direct uses of :class:`AMoLEConfig` keep the paper's 30.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from adapters.amole import load_balance_loss
from adapters.amole_layer import SHARED, add_amole_experts, expert_name
from adapters.amole_routing import AMoLERouting
from adapters.rundir import RunDir
from training.algorithms.fedamole.options import OPTIONS
from training.algorithms.fedamole.rsea import (
    AMoLEConfig,
    add_dp_noise,
    add_gaussian_noise,
    assign_experts,
    mean_over_holders,
    relevance_scores,
    scores_source,
    vanilla_relevance,
)
from training.algorithms.fedamole.rsea_embed import EmbeddingAccumulator
from training.data import collate
from training.local.lm_forward import lm_forward
from training.local.regime import Regime
from training.local.runtime import Runtime
from training.local.train import LossFn, train_adapters
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method, Strategy, layout_problem
from training.state import StateDict, derive_seed

EMB = "emb."
# Paper 002 App. D.1.2: Adam, batch 1, lr decayed x0.99 per round; the lr (5e-5), 200 steps per round, 30 rounds
# and no schedule inside a round are the reference code's (the numbers are missing from the paper's text,
# docs/methods.md 1.7-1.8).
REGIME = Regime(optimizer="adam", lr=5e-5, schedule="constant", round_decay=0.99, batch_size=1, local_epochs=1,
                max_steps=200, rounds=30, source="paper 002 App. D.1.2 (Adam, batch 1, x0.99/round); "
                "lr 5e-5, 200 steps, 30 rounds: reference code")


EXPERTS_PER_CLIENT = 3  # paper 002 App. D: 30 experts for 10 clients, k_c = 2: a mean of 6 per client-module


def client_defaults(n_clients: int) -> dict[str, Any]:
    """The expert count for ``n_clients``: the paper's 30 / 10 per client."""
    return {"num_experts": EXPERTS_PER_CLIENT * n_clients}


def ensure_experts(rt: Runtime, cfg: AMoLEConfig, seed: int) -> None:
    """Inject the expert pool, shared expert and token projections once per runtime."""
    if expert_name(0) not in rt.adapted.configs:
        add_amole_experts(rt.adapted, cfg.num_experts, rt.train.lora, seed=seed, shared=cfg.shared_expert,
                          router=cfg.router)


def full_state(rt: Runtime) -> StateDict:
    """Every expert's A/B and every token projection, keyed ``<path>.<expert>.lora_A`` / ``<path>.token_proj``.

    CPU copies, as every state that leaves the model (:meth:`training.local.runtime.Runtime.get`).
    """
    state: StateDict = {}
    for path, layer in rt.adapted.layers.items():
        for name, adapter in layer.adapters.items():
            if name.startswith("expert_"):
                state[f"{path}.{name}.lora_A"] = adapter.lora_A.detach().to("cpu", copy=True)
                state[f"{path}.{name}.lora_B"] = adapter.lora_B.detach().to("cpu", copy=True)
        if layer.token_proj is not None:
            state[f"{path}.token_proj"] = layer.token_proj.detach().to("cpu", copy=True)
    return state


def load_state(rt: Runtime, state: Mapping[str, torch.Tensor]) -> None:
    """Copy the given subset of :func:`full_state` tensors into the model."""
    with torch.no_grad():
        for key, value in state.items():
            if key.startswith(EMB):
                continue
            if key.endswith(".token_proj"):
                proj = rt.adapted.layers[key[: -len(".token_proj")]].token_proj
                assert proj is not None
                proj.copy_(value)
                continue
            path, name, which = key.rsplit(".", 2)
            getattr(rt.adapted.layers[path].adapters[name], which).copy_(value)
    for layer in rt.adapted.layers.values():
        layer.invalidate_cache()


def subset(state: Mapping[str, torch.Tensor], assignment: Mapping[str, list[int]], shared: bool) -> StateDict:
    """What one client receives/uploads: its experts per module, the shared expert, the projections."""
    keep: StateDict = {}
    for key, value in state.items():
        if key.endswith(".token_proj"):
            keep[key] = value
            continue
        path, name, _ = key.rsplit(".", 2)
        if (shared and name == SHARED) or (name != SHARED and int(name.split("_")[1]) in assignment.get(path, [])):
            keep[key] = value
    return keep


class FedAMoLEStrategy(Strategy):
    """Server: aggregate over holders, then reverse-selection expert assignment (RSEA)."""

    def __init__(self, cfg: AMoLEConfig, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, seed
        self.assignment: dict[str, dict[str, list[int]]] | None = None
        self.scores: dict[str, list[list[float]]] | None = None  # module -> (N_e, N_c) relevance
        self.score_clients: list[str] | None = None  # the clients of the score columns, in column order
        self.local: dict[str, StateDict] = {}  # export=local: each client's last upload before aggregation

    def initial_state(self, runtime: Runtime) -> StateDict:
        ensure_experts(runtime, self.cfg, self.seed)
        return full_state(runtime)

    def _assign(self, round_idx: int, clients: list[str], modules: list[str]) -> None:
        source = scores_source(self.cfg, round_idx)
        if source == "keep" and self.assignment is not None:
            return
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, "rsea", round_idx))
        scores = None
        order = self.score_clients or []
        if source == "relevance" and self.scores is not None and set(order) == set(clients):
            # Columns follow the upload order (a Flower server receives replies as they come): reorder them.
            cols = [order.index(c) for c in clients]
            scores = {m: torch.tensor(v, dtype=torch.float64, device="cpu")[:, cols] for m, v in self.scores.items()}
        self.assignment = assign_experts(scores, self.cfg, clients, modules, gen)

    def configure_round(self, round_idx: int, clients: list[str], state: StateDict) -> dict[str, FitIns]:
        modules = sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".token_proj")})
        self.cfg.check_clients(len(clients))  # before any work: the error names the sizes that fit
        if self.assignment is None or scores_source(self.cfg, round_idx) != "keep":
            self._assign(round_idx, clients, modules)
        assert self.assignment is not None  # _assign just set it
        missing = set(clients) - set(next(iter(self.assignment.values())))
        if missing:
            raise ValueError(f"FedAMoLE assigns experts to all clients every round; {sorted(missing)} were not "
                             "part of the assignment (use fraction 1)")
        out = {}
        for c in clients:
            mine = {m: self.assignment[m][c] for m in modules}
            out[c] = FitIns(round_idx, subset(state, mine, self.cfg.shared_expert), {"assignment": mine})
        return out

    def check_upload(self, ins: FitIns, res: FitRes) -> str | None:
        """The experts sent, trained, plus one embedding per module and held expert (1-D, one length, float)."""
        problem = layout_problem(ins.state, {k: v for k, v in res.state.items() if not k.startswith(EMB)})
        if problem is not None:
            return problem
        assignment = ins.config.get("assignment", {})
        allowed = {f"{EMB}{m}.client" for m in assignment}
        allowed |= {f"{EMB}{m}.{expert_name(j)}" for m, ids in assignment.items() for j in ids}
        emb = {k: v for k, v in res.state.items() if k.startswith(EMB)}
        extra = sorted(set(emb) - allowed)
        if extra:
            return f"upload has unexpected embeddings, e.g. {extra[:2]}"
        if any(v.dim() != 1 or not v.is_floating_point() for v in emb.values()):
            return "every embedding must be a 1-D float tensor"
        if len({v.shape[0] for v in emb.values()}) > 1:
            return "embeddings differ in length"
        return None

    def aggregate(self, round_idx: int, results: list[FitRes], failures: list[tuple[str, str]],
                  state: StateDict) -> StateDict | None:
        if not results:
            return None
        uploads = {r.client_id: {k: v for k, v in r.state.items() if not k.startswith(EMB)} for r in results}
        if self.cfg.export == "local":
            self.local = uploads  # the last round's stay: the reference evaluates these, not the averages
        new = dict(state)
        new.update(mean_over_holders(uploads))
        self._relevance(results)
        return new

    def _relevance(self, results: list[FitRes]) -> None:
        """Relevance of every expert to every client per module (eq. 18-20), for the next assignment."""
        clients = [r.client_id for r in results]
        per_client_expert = {r.client_id: {k: v for k, v in r.state.items() if k.startswith(EMB) and ".expert_" in k}
                             for r in results}
        expert_emb = mean_over_holders(per_client_expert)  # eq. 18: mean over holders
        self.scores = {}
        modules = sorted({k[len(EMB):].rsplit(".", 1)[0] for r in results for k in r.state if k.endswith(".client")})
        for m in modules:
            if self.cfg.router == "vanilla":  # each client's mean router logits, one per expert
                C = torch.stack([r.state[f"{EMB}{m}.client"] for r in results])  # (N_c, N_e)
                self.scores[m] = vanilla_relevance(C.double()).tolist()
                continue
            r_dim = results[0].state[f"{EMB}{m}.client"].shape[-1]
            E = torch.stack([expert_emb.get(f"{EMB}{m}.{expert_name(j)}", torch.zeros(r_dim, device="cpu"))
                             for j in range(self.cfg.num_experts)])  # (N_e, r)
            C = torch.stack([r.state[f"{EMB}{m}.client"] for r in results])  # (N_c, r)
            self.scores[m] = relevance_scores(E.double(), C.double()).tolist()
        self.score_clients = clients
        if self.assignment and set(clients) != set(next(iter(self.assignment.values()))):
            self.scores = None  # a client failed: its column is missing, fall back to random scores

    def state_dict(self) -> dict[str, Any]:
        return {"assignment": self.assignment, "scores": self.scores, "score_clients": self.score_clients,
                "local": self.local}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        self.assignment = data.get("assignment")
        self.scores = data.get("scores")
        # Checkpoints without the column order were written by the simulator: columns in assignment order.
        default = list(next(iter(self.assignment.values()))) if self.assignment else None
        self.score_clients = data.get("score_clients", default)
        self.local = {c: dict(s) for c, s in (data.get("local") or {}).items()}

    def summary(self) -> dict[str, Any]:
        return {"amole": json.loads(json.dumps(self.cfg.__dict__))}


def amole_loss(cfg: AMoLEConfig, assignment: Mapping[str, list[int]]) -> LossFn:
    """NLL + ``load_balance_alpha`` * the load-balance loss summed over modules (eqs. 25-27, docs/methods.md 1.3).

    Every row routes over the client's ``assignment``. Padding tokens are left out of the load-balance
    loss: the reference trains at batch size 1 (no padding) and counts every real token, prompt included.
    """

    def loss_fn(rt: Runtime, batch: dict[str, torch.Tensor], names, weights):
        # one client: every row in group 0 (host-side grouping, see AMoLERouting.row_group)
        rows = torch.zeros(batch["input_ids"].shape[0], dtype=torch.long, device="cpu")
        routing = AMoLERouting(groups=(dict(assignment),), row_group=rows, top_k=cfg.top_k,
                               shared=cfg.shared_expert, router=cfg.router)
        with rt.adapted.context.route_tokens(routing):
            out = lm_forward(rt.model, batch)
        assert out.loss is not None
        tokens = batch["attention_mask"].reshape(-1).bool()  # gates are (B*T, E), row-major
        lb = torch.stack([load_balance_loss(g, idx, tokens) for _, g, idx in routing.stats]).sum()
        return out.loss + cfg.load_balance_alpha * lb, {"load_balance": float(lb.detach())}

    return loss_fn


class FedAMoLEClient(ClientAlgorithm):
    """Client: train assigned experts + shared + projections with AMoLE routing, then embed."""

    def __init__(self, cfg: AMoLEConfig, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, seed

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        rt, cfg = ctx.runtime, self.cfg
        ensure_experts(rt, cfg, self.seed)
        load_state(rt, ins.state)
        assignment: dict[str, list[int]] = {m: list(v) for m, v in ins.config["assignment"].items()}
        held = sorted({expert_name(j) for ids in assignment.values() for j in ids})
        trainable = held + ([SHARED] if cfg.shared_expert else [])
        projs = [layer.token_proj for layer in rt.adapted.layers.values() if layer.token_proj is not None]
        for p in projs:
            p.requires_grad_(True)

        loss_fn = amole_loss(cfg, assignment)
        try:
            res = train_adapters(rt, rt.examples(ctx.data), trainable, (), (), seed=derive_seed(ctx.seed, ins.round,
                                 ctx.client_id, "amole"), loss_fn=loss_fn, desc=f"r{ins.round} {ctx.client_id} amole",
                                 extra_params=projs, round_idx=ins.round)
        finally:
            for p in projs:
                p.requires_grad_(False)
        upload = subset(full_state(rt), assignment, cfg.shared_expert)
        upload.update(self._embeddings(rt, ctx, assignment, ins.round))
        return FitRes(ctx.client_id, upload, len(ctx.data.train), res.metrics())

    def _embeddings(self, rt: Runtime, ctx: ClientContext, assignment: dict[str, list[int]],
                    round_idx: int) -> StateDict:
        """Client and expert embeddings over the embedding set (eq. 17, 19), noised if configured (C.2)."""
        examples = rt.examples(ctx.data)
        n = min(200, max(1, len(examples) // 20))
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(ctx.seed, "emb", ctx.client_id))
        order = torch.randperm(len(examples), generator=gen, device="cpu")
        accs: dict[str, EmbeddingAccumulator] = {}
        for start in range(0, n, rt.train.micro_batch_size):
            batch = collate([examples[i] for i in order[start:min(n, start + rt.train.micro_batch_size)].tolist()],
                            pad_id=rt.tokenizer.pad_token_id, device=rt.device)
            mask = batch["attention_mask"].bool()

            def observe(path, g, h, P, A, mask=mask):
                accs.setdefault(path, EmbeddingAccumulator()).add(h, P, A, mask)

            routing = AMoLERouting(groups=(assignment,), row_group=torch.zeros(mask.shape[0], dtype=torch.long,
                                                                               device="cpu"),
                                   top_k=self.cfg.top_k, shared=self.cfg.shared_expert, observer=observe,
                                   router=self.cfg.router)
            # under the model's dtype policy, as training's forwards: an autocast-bf16 model keeps its frozen
            # linear weights in bf16 (models.loaded.store_linear_bf16), which fp32 activations cannot meet
            with torch.inference_mode(), rt.adapted.context.route_tokens(routing), rt.loaded.autocast():
                lm_forward(rt.model, batch, with_loss=False)  # the adapted layers observe; no head needed
        # Noise from its own (seed, round, client) stream: the global RNG, and so training, is untouched.
        noise_seed = derive_seed(ctx.seed, "embed-noise", round_idx, ctx.client_id)
        gen, rng = torch.Generator(device="cpu").manual_seed(noise_seed), np.random.default_rng(noise_seed)
        out: StateDict = {}
        for path in sorted(accs):
            acc = accs[path]
            c, e = (t.cpu() for t in acc.result())  # (r,), (E, r): uploads, noised on the CPU
            if self.cfg.dp_noise:
                tok_bound, exp_bound = acc.max_clean_norms
                exp_bound = exp_bound.cpu()
                c = add_dp_noise(c, self.cfg.dp_eta, tok_bound, rng)
                e = add_dp_noise(e, self.cfg.dp_eta, exp_bound, rng)
            elif self.cfg.embed_noise > 0:
                c = add_gaussian_noise(c, self.cfg.embed_noise, gen)
                e = add_gaussian_noise(e, self.cfg.embed_noise, gen)
            out[f"{EMB}{path}.client"] = c.float()
            if self.cfg.router == "vanilla":  # c holds the mean logit of every expert: nothing else is scored
                continue
            for row, j in enumerate(assignment[path]):
                out[f"{EMB}{path}.{expert_name(j)}"] = e[row].float()
        return out


def _cfg(o: Mapping[str, Any]) -> AMoLEConfig:
    """The AMoLE settings from method options (``shared-expert`` and ``shared_expert`` both accepted)."""
    keys = AMoLEConfig.__dataclass_fields__
    opts = {k.replace("-", "_"): v for k, v in o.items() if k != "seed"}
    unknown = sorted(set(opts) - set(keys))
    if unknown:
        raise ValueError(f"unknown FedAMoLE option(s) {unknown}; options: {sorted(keys)}")
    return AMoLEConfig(**opts)


def export(run: RunDir, rt: Runtime, state: StateDict, strategy: Strategy) -> None:
    """Write the experts, token projections and each client's final assignment (``adapters/amole``).

    With ``export=local`` also each client's personalised model as the reference evaluates it: the
    aggregated pool with the client's last-round uploads (its experts, shared expert and token
    projections, trained locally, before aggregation) in place, under its last assignment, in
    ``adapters/clients/<id>/amole`` (servable by path, like any AMoLE folder).

    Raises:
        TypeError: ``strategy`` is not FedAMoLE's server half (the round loop hands over the method's own).
    """
    from adapters.amole_io import save_amole

    if not isinstance(strategy, FedAMoLEStrategy):
        raise TypeError(f"FedAMoLE's export needs its FedAMoLEStrategy, got {type(strategy).__name__}")
    load_state(rt, state)
    per_client: dict[str, dict[str, list[int]]] = {}
    for module, clients in (strategy.assignment or {}).items():
        for client, ids in clients.items():
            per_client.setdefault(client, {})[module] = ids
    save_amole(rt.adapted, run.amole, strategy.cfg.num_experts, per_client, top_k=strategy.cfg.top_k,
               router=strategy.cfg.router)
    if strategy.cfg.export != "local":
        return
    for client, upload in strategy.local.items():
        load_state(rt, state)
        load_state(rt, upload)
        # strategy.assignment is still the last round's (the next is only solved in configure_round)
        save_amole(rt.adapted, run.client_dir(client) / "amole", strategy.cfg.num_experts,
                   {client: per_client[client]},
                   top_k=strategy.cfg.top_k, router=strategy.cfg.router)
    load_state(rt, state)


FEDAMOLE = Method(
    name="fedamole", strategy=lambda o: FedAMoLEStrategy(_cfg(o), int(o.get("seed", 0))),
    client=lambda o: FedAMoLEClient(_cfg(o), int(o.get("seed", 0))),
    options=OPTIONS,
    export=export, regime=REGIME, client_defaults=client_defaults,
)
