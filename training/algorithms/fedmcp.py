"""FedMCP (paper 004): global + private adapters with averaged outputs and a CKA contrast term.

Per batch (paper 004 section 3; METHODS.md 5, LoRA adapters and the LM head instead of bottleneck
adapters and classifiers, our decision):
    L_a: LM loss of the full model, both adapters at weight 1/2 (Y = its mean-pooled final states)
    L_b: LM loss with the client's global adapter alone (X = its states)
    L_c: CKA(X, Y) - CKA(X, Z), Z = states with the received averaged global (frozen)
    L = (1 - gamma) L_a + gamma L_b + mu L_c,   gamma 0.5, mu 0.05
Both adapters train; only the global is uploaded and averaged uniformly; the private one stays local.
L_c is computed over the optimizer step's whole batch (64 in the paper), whatever ``--micro-batch-size``
is: linear CKA does not decompose over micro-batches (:class:`FedMCPLoss`). ``similarity=cosine`` is the
paper's ablation (section 4.4: cosine similarity instead of CKA, -1.45 %): mean row-wise cosine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from training.algorithms.fedit import FedAvgStrategy
from training.algorithms.local import fresh_local
from training.batch_terms import SplitTerm, eval_mode, micro_share, split_term
from training.cka import linear_cka
from training.features import mean_pool
from training.lm_forward import lm_forward
from training.local_train import train_adapters
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method, Strategy, derive_seed
from training.regime import Regime
from training.robust import RobustConfig
from training.runtime import Runtime

# Paper 004 section 4.1: Adam, lr 5e-4, batch 64, one local epoch per round, 25 rounds (no schedule named).
REGIME = Regime(optimizer="adam", lr=5e-4, schedule="constant", batch_size=64, local_epochs=1, rounds=25,
                source="paper 004 s4.1 (Adam 5e-4, batch 64, 1 epoch, 25 rounds)")


def similarity(a: torch.Tensor, b: torch.Tensor, kind: str = "cka") -> torch.Tensor:
    """FedMCP's representation similarity: linear CKA (paper) or the mean row-wise cosine (its ablation)."""
    if kind == "cka":
        return linear_cka(a, b)
    if kind == "cosine":
        return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean()
    raise ValueError(f"FedMCP similarity must be cka or cosine, got {kind!r}")


def _pooled(rt: Runtime, batch: dict[str, torch.Tensor], adapter: str | None, labels: bool = False,
            trainable: tuple[str, ...] = ()) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(LM loss or None, mean-pooled final-layer states (B, H)); ``adapter`` None keeps the caller's context."""
    mask = batch["attention_mask"]
    if adapter is None:
        out = lm_forward(rt.model, batch, with_loss=labels)
    else:
        with rt.adapted.context.use((adapter,), torch.ones(mask.shape[0], 1, device=mask.device), trainable=trainable):
            out = lm_forward(rt.model, batch, with_loss=labels)
    return out.loss, mean_pool(out.hidden, mask)


class FedMCPLoss:
    """FedMCP's objective, its contrast term over the whole logical batch (:mod:`training.batch_terms`).

    Linear CKA does not decompose over micro-batches, so the term is the optimizer step's whatever
    ``--micro-batch-size`` is. A :class:`training.local_train.BatchLoss`; the caller's context has
    (global, local) on at (1/2, 1/2), both trainable.
    """

    length_grouped = True  # its LM losses read the rows' weights; L_c is the whole step's

    def __init__(self, gamma: float, mu: float, kind: str = "cka") -> None:
        self.gamma, self.mu, self.kind = gamma, mu, kind
        self._split: SplitTerm | None = None
        self._index = 0

    def _term(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.mu * (similarity(x, y, self.kind) - similarity(x, z.detach(), self.kind))

    def begin_step(self, rt: Runtime, batches: Sequence[dict[str, torch.Tensor]], names: Sequence[str],
                   weights: torch.Tensor) -> None:
        self._split, self._index = None, 0
        if len(batches) < 2 or self.mu == 0:
            return  # one forward holds the whole batch: computed directly
        feats, consts = [], []
        with eval_mode(rt.model):
            for b in batches:
                with rt.adapted.context.use(tuple(names), weights.expand(b["input_ids"].shape[0], -1), trainable=()):
                    y = _pooled(rt, b, None)[1]
                feats.append((_pooled(rt, b, "global")[1], y))
                consts.append((_pooled(rt, b, "received")[1],))
        self._split = split_term(self._term, feats, consts)

    def __call__(self, rt: Runtime, batch: dict[str, torch.Tensor], names, weights):
        full_loss, y = _pooled(rt, batch, None, labels=True)
        glob_loss, x = _pooled(rt, batch, "global", labels=True, trainable=("global",))
        assert full_loss is not None and glob_loss is not None
        loss = (1 - self.gamma) * full_loss + self.gamma * glob_loss
        if self._split is not None:
            share = micro_share(self._split, self._index, (x, y))
            self._index += 1
            return loss + share, {"cka_contrast": float(self._split.value) / self.mu}
        if x.shape[0] < 2 or self.mu == 0:  # CKA needs a centred sample of at least 2 rows
            return loss, {}
        with torch.no_grad():
            z = _pooled(rt, batch, "received")[1]
        term = self._term(x, y, z)
        return loss + term, {"cka_contrast": float(term.detach()) / self.mu}


def fedmcp_loss(gamma: float, mu: float, kind: str = "cka") -> FedMCPLoss:
    """FedMCP's objective; the caller's context has (global, local) on at (1/2, 1/2), both trainable."""
    return FedMCPLoss(gamma, mu, kind)


class FedMCPClient(ClientAlgorithm):
    """Client of FedMCP: both adapters trained together; uploads the global one."""

    def __init__(self, gamma: float = 0.5, mu: float = 0.05, similarity: str = "cka") -> None:
        if not 0 <= gamma <= 1 or mu < 0 or similarity not in ("cka", "cosine"):
            raise ValueError(f"FedMCP needs gamma in [0, 1], mu >= 0 and similarity cka or cosine, "
                             f"got {gamma}, {mu}, {similarity!r}")
        self.gamma, self.mu, self.similarity = gamma, mu, similarity

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        rt = ctx.runtime
        rt.set("global", ins.state)
        rt.set("received", ins.state)
        rt.set("local", ctx.private.get("local") or fresh_local(ctx))
        res = train_adapters(rt, rt.examples(ctx.data), ["global", "local"], ["global", "local"], [0.5, 0.5],
                             seed=derive_seed(ctx.seed, ins.round, ctx.client_id, "mcp"),
                             loss_fn=fedmcp_loss(self.gamma, self.mu, self.similarity),
                             desc=f"r{ins.round} {ctx.client_id} mcp", round_idx=ins.round)
        ctx.private["local"] = rt.get("local")
        return FitRes(ctx.client_id, rt.get("global"), len(ctx.data.train), res.metrics())


def _strategy(o: Mapping[str, Any]) -> Strategy:
    return FedAvgStrategy(seed=int(o.get("seed", 0)), weighting="equal", robust=RobustConfig.from_options(o))


FEDMCP = Method(
    name="fedmcp", strategy=_strategy,
    client=lambda o: FedMCPClient(gamma=float(o.get("gamma", 0.5)), mu=float(o.get("mu", 0.05)),
                                  similarity=str(o.get("similarity", "cka"))),
    has_local=True, inference_weight=0.5, defaults={"gamma": 0.5, "mu": 0.05, "similarity": "cka"}, regime=REGIME,
)
