"""Reverse-Selection Expert Assignment (RSEA): embeddings, relevance, assignment, aggregation.

FedAMoLE (paper 002, section 4.4, equations (17)-(21) and (28); Appendix C.2-C.3; docs/methods.md
1.4-1.6). Per AMoLE module, every round:

* client side, after local training: ``c_i = mean_t P h_t`` (17) and ``e_{j,i} = mean_t A_j h_t``
  (19) over the client's embedding set, optional noise on the uploads (both in
  :mod:`training.algorithms.fedamole.rsea_embed`): the reference code's Gamma-magnitude noise (``dp_noise``) or the
  Gaussian mechanism (``embed_noise``) of the DP work section C.2 points to;
* server side: ``e_j = mean_{i holding j} e_{j,i}`` (18), relevance
  ``s_{j,i} = e_j . c_i / sqrt(r)`` (20), selection probabilities ``softmax_i s_{j,i}`` (28), then
  the MILP of Appendix C.3
  (:mod:`training.algorithms.fedamole.rsea_milp`); round 0 and the random ablation use U(0, 1) scores instead;
* aggregation (section 4.3): token projection averaged over all clients, each domain expert over
  the clients that held it, the shared expert over all clients. No data-size weighting.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import torch

from adapters.amole import Router
from training.algorithms.fedamole.rsea_embed import EmbeddingAccumulator, add_dp_noise, add_gaussian_noise
from training.algorithms.fedamole.rsea_milp import Solver, client_bounds, solve_assignment

__all__ = [
    "AMoLEConfig",
    "EmbeddingAccumulator",
    "add_dp_noise",
    "add_gaussian_noise",
    "aggregate_experts",
    "aggregate_token_proj",
    "assign_experts",
    "mean_over_holders",
    "random_scores",
    "relevance_scores",
    "scores_source",
    "selection_probabilities",
    "server_expert_embeddings",
    "vanilla_relevance",
]

Assignment = Literal["rsea", "static", "random"]
K = TypeVar("K", bound=Hashable)
C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True)
class AMoLEConfig:
    """FedAMoLE hyper-parameters (defaults = paper and reference code, docs/methods.md 1.8).

    Attributes:
        num_experts: domain experts per module, N_e.
        expert_choices: clients each expert selects per round, k_c.
        top_k: domain experts per token.
        min_experts: fewest experts per client-module (hard-coded 2 in the reference).
        max_experts: most experts per client-module.
        load_balance_alpha: weight of the summed load-balance loss.
        shared_expert: False is the FedAMoLE-S ablation.
        assignment: "rsea" (paper), "static" (FedMoLE: random at round 0, then fixed) or
            "random" (FedAMoLE-R: random every round).
        homogeneous: every client holds N_e k_c / N_c experts (``homo_arch``).
        solver: MILP solver, "highs" (scipy) or "scip" (optional pyscipopt).
        dp_noise: the reference code's ``--apply_dp``: Gamma-magnitude noise on every uploaded
            embedding, rescaled under the largest clean norm (docs/methods.md 1.4).
        dp_eta: rate of the noise's Gamma magnitude (larger: less noise).
        export: what the run's final model is. ``local`` (default): besides the server's pool, each client's
            last-round locally trained experts, shared expert and projections before aggregation
            (``adapters/clients/<id>/amole``), the model paper App. D.1.1 and the reference code evaluate
            (docs/methods.md 1.9). ``aggregated``: only the server's experts and projections after the last
            aggregation (``adapters/amole``, one servable model).
        embed_noise: standard deviation of Gaussian noise added to every coordinate of every
            uploaded client and expert embedding (the Gaussian mechanism of Wei et al. 2020, which
            paper 002 C.2 cites); 0 is off. Training is unchanged; only the relevance scores, and
            so the next round's assignment, see the noise.
        router: ``amole`` (the paper's shape-invariant gate) or ``vanilla`` (FedAMoLE-A, section 5.5: a
            linear MoLE router over all N_e experts per module, top-k among the assigned ones; the
            relevance of expert j to client i is then the router's mean logit for j over the client's
            embedding set, :func:`vanilla_relevance`).
    """

    num_experts: int = 30
    expert_choices: int = 2
    top_k: int = 2
    min_experts: int = 2
    max_experts: int = 8
    load_balance_alpha: float = 0.001
    shared_expert: bool = True
    assignment: Assignment = "rsea"
    homogeneous: bool = False
    solver: Solver = "highs"
    dp_noise: bool = False
    dp_eta: float = 100.0
    embed_noise: float = 0.0
    export: str = "local"
    router: Router = "amole"

    def __post_init__(self) -> None:
        for name in ("shared_expert", "homogeneous", "dp_noise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("num_experts", "expert_choices", "top_k", "min_experts", "max_experts"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.num_experts < 1 or self.expert_choices < 1 or self.top_k < 1:
            raise ValueError("num_experts, expert_choices and top_k must be >= 1")
        if not 1 <= self.min_experts <= self.max_experts:
            # The gate needs at least one routed expert per client-module.
            raise ValueError(
                f"need 1 <= min_experts <= max_experts, got {self.min_experts}, {self.max_experts}"
            )
        if self.load_balance_alpha < 0:
            raise ValueError(f"load_balance_alpha must be >= 0, got {self.load_balance_alpha}")
        if self.assignment not in ("rsea", "static", "random"):
            raise ValueError(f"assignment must be rsea, static or random, got {self.assignment!r}")
        if self.router not in ("amole", "vanilla"):
            raise ValueError(f"router must be amole or vanilla (FedAMoLE-A), got {self.router!r}")
        if self.export not in ("aggregated", "local"):
            raise ValueError(f"export must be aggregated or local, got {self.export!r}")
        if self.solver not in ("highs", "scip"):
            raise ValueError(f"solver must be highs or scip, got {self.solver!r}")
        if self.dp_eta <= 0:
            raise ValueError(f"dp_eta must be > 0, got {self.dp_eta}")
        if not self.embed_noise >= 0:
            raise ValueError(f"embed_noise (a standard deviation) must be >= 0, got {self.embed_noise}")
        if self.embed_noise > 0 and self.dp_noise:
            raise ValueError("choose one embedding noise: dp_noise (reference) or embed_noise (Gaussian), not both")

    def check_clients(self, num_clients: int) -> None:
        """Raise ValueError if no assignment exists for ``num_clients``, naming the numbers and what fits."""
        try:
            client_bounds(
                self.num_experts, num_clients, self.expert_choices, self.min_experts,
                self.max_experts, self.homogeneous,
            )
        except ValueError as exc:
            lo = -(-num_clients * self.min_experts // self.expert_choices)  # ceil: all reach min_experts
            hi = num_clients * self.max_experts // self.expert_choices  # none above max_experts
            hint = (f"num_experts between {lo} and {hi} (e.g. --option num_experts={hi})" if lo <= hi
                    else "other expert_choices / min_experts / max_experts")
            if self.homogeneous:
                hint = f"num_experts * expert_choices divisible by {num_clients} (homogeneous)"
            raise ValueError(
                f"FedAMoLE with {num_clients} clients: {exc}. The paper's defaults are for 10 clients; "
                f"with expert_choices={self.expert_choices}, min_experts={self.min_experts} and "
                f"max_experts={self.max_experts} use {hint}"
            ) from exc


def mean_over_holders(per_client: Mapping[C, Mapping[K, torch.Tensor]]) -> dict[K, torch.Tensor]:
    """Average each key's tensor over the clients that hold that key (unweighted)."""
    groups: dict[K, list[torch.Tensor]] = {}
    for held in per_client.values():
        for key, value in held.items():
            groups.setdefault(key, []).append(value)
    return {key: torch.stack(vals).mean(0) for key, vals in groups.items()}


def server_expert_embeddings(
    per_client: Mapping[C, Mapping[int, torch.Tensor]], num_experts: int
) -> torch.Tensor:
    """Server expert embeddings ``e_j`` (18): unweighted mean over the clients that held expert j.

    Args:
        per_client: client -> expert id -> (r,) per-client expert embedding ``e_{j,i}``.
        num_experts: N_e.

    Returns:
        (N_e, r). An expert no client held (only possible when clients drop out) gets a zero row,
        i.e. equal relevance to every client.
    """
    means = mean_over_holders(per_client)
    if not means:
        raise ValueError("no expert embeddings received")
    r = next(iter(means.values())).shape[-1]
    out = torch.zeros(num_experts, r, device="cpu")  # server side: scores feed the CPU MILP
    for j, vec in means.items():
        out[j] = vec.float()
    return out


def relevance_scores(expert_emb: torch.Tensor, client_emb: torch.Tensor) -> torch.Tensor:
    """``s_{j,i} = e_j . c_i / sqrt(r)`` (20): (N_e, r), (N_c, r) -> (N_e, N_c)."""
    return expert_emb @ client_emb.T / math.sqrt(expert_emb.shape[-1])


def vanilla_relevance(client_logits: torch.Tensor) -> torch.Tensor:
    """FedAMoLE-A's relevance: ``s_{j,i} = mean_t W_j . h_t`` over client i's embedding set: (N_c, N_e) -> (N_e, N_c).

    The vanilla router has no token projection to embed tokens with (eq. (17)); the analogue of (20),
    ``mean_t`` of the score expert j gets for client i's tokens, is the router's own mean logit, which each
    client computes as its "client embedding" (the mean of ``W h``, one value per expert).
    """
    return client_logits.T


def selection_probabilities(scores: torch.Tensor) -> torch.Tensor:
    """Equation (28): softmax over clients, so each expert's row sums to 1. (N_e, N_c)."""
    return torch.softmax(scores.double(), dim=1)


def random_scores(num_experts: int, num_clients: int, generator: torch.Generator) -> torch.Tensor:
    """U(0, 1) scores for round 0 and the random-assignment ablation. (N_e, N_c)."""
    return torch.rand(num_experts, num_clients, generator=generator, dtype=torch.float64, device=generator.device)


def scores_source(config: AMoLEConfig, round_idx: int) -> Literal["random", "relevance", "keep"]:
    """Where round ``round_idx``'s assignment comes from (0 = the first dispatch)."""
    if round_idx == 0 or config.assignment == "random":
        return "random"
    return "relevance" if config.assignment == "rsea" else "keep"


def assign_experts(
    scores: Mapping[str, torch.Tensor | np.ndarray] | None,
    config: AMoLEConfig,
    clients: Sequence[C],
    modules: Sequence[str] | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, dict[C, list[int]]]:
    """Assign domain experts to clients for every module, each module solved independently.

    Args:
        scores: module -> (N_e, N_c) relevance scores (20), columns in ``clients`` order; None
            draws U(0, 1) scores per module (round 0, ablations), which needs ``modules``.
        config: the FedAMoLE settings (k_c, bounds, homogeneous, solver).
        clients: client ids, one per score column.
        modules: module names; defaults to the keys of ``scores``.
        generator: seeded generator for random scores.

    Returns:
        module -> client -> sorted domain-expert ids. The shared expert is implicit (always on).
    """
    config.check_clients(len(clients))
    if scores is None:
        if modules is None:
            raise ValueError("random assignment needs the module names")
        gen = generator if generator is not None else torch.Generator(device="cpu").manual_seed(0)
        scores = {m: random_scores(config.num_experts, len(clients), gen) for m in modules}
    names = list(modules) if modules is not None else list(scores)
    result: dict[str, dict[C, list[int]]] = {}
    for name in names:
        raw = scores[name]
        # the MILP runs on the CPU: scores computed on a GPU are copied here
        s = raw.detach().to("cpu", torch.float64) if isinstance(raw, torch.Tensor) else \
            torch.as_tensor(np.asarray(raw), dtype=torch.float64)
        if s.shape != (config.num_experts, len(clients)):
            raise ValueError(
                f"{name}: scores shape {tuple(s.shape)} != ({config.num_experts}, {len(clients)})"
            )
        X = solve_assignment(
            selection_probabilities(s).numpy(),
            k_c=config.expert_choices,
            e_min=config.min_experts,
            e_max=config.max_experts,
            homogeneous=config.homogeneous,
            solver=config.solver,
        )
        result[name] = {c: np.flatnonzero(X[:, i]).tolist() for i, c in enumerate(clients)}
    return result


def aggregate_token_proj(token_projs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Plain mean of every client's (r, d) token projection (all clients, no size weighting)."""
    if not token_projs:
        raise ValueError("no token projections to aggregate")
    return torch.stack(list(token_projs)).mean(0)


def aggregate_experts(
    per_client: Mapping[C, Mapping[K, tuple[torch.Tensor, torch.Tensor]]],
) -> dict[K, tuple[torch.Tensor, torch.Tensor]]:
    """Average each expert's (A, B) over the clients that held it this round.

    The shared expert, held by every client under one key (e.g. ``"shared"``), thereby comes out
    averaged over all clients.

    Args:
        per_client: client -> expert id -> (A (r, d), B (o, r)).

    Returns:
        expert id -> (A_mean, B_mean).
    """
    items = per_client.items()
    a_means = mean_over_holders({c: {k: a for k, (a, _) in held.items()} for c, held in items})
    b_means = mean_over_holders({c: {k: b for k, (_, b) in held.items()} for c, held in items})
    return {k: (a_means[k], b_means[k]) for k in a_means}
