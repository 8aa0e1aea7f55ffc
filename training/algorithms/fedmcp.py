"""FedMCP (paper 004): global + private adapters with averaged outputs and a CKA contrast term.

Per batch (paper 004 section 3; METHODS.md 5, LoRA adapters and the LM head instead of bottleneck
adapters and classifiers, our decision):
    L_a: LM loss of the full model, both adapters at weight 1/2 (Y = its mean-pooled final states)
    L_b: LM loss with the client's global adapter alone (X = its states)
    L_c: CKA(X, Y) - CKA(X, Z), Z = states with the received averaged global (frozen)
    L = (1 - gamma) L_a + gamma L_b + mu L_c,   gamma 0.5, mu 0.05
Both adapters train; only the global is uploaded and averaged uniformly; the private one stays local.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from training.algorithms.fedit import FedAvgStrategy
from training.algorithms.local import fresh_local
from training.cka import linear_cka
from training.features import mean_pool
from training.local_train import train_adapters
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method, Strategy, derive_seed
from training.regime import Regime
from training.runtime import Runtime

# Paper 004 section 4.1: Adam, lr 5e-4, batch 64, one local epoch per round, 25 rounds (no schedule named).
REGIME = Regime(optimizer="adam", lr=5e-4, schedule="constant", batch_size=64, local_epochs=1, rounds=25,
                source="paper 004 s4.1 (Adam 5e-4, batch 64, 1 epoch, 25 rounds)")


def fedmcp_loss(gamma: float, mu: float):
    """FedMCP's objective; the caller's context has (global, local) on at (1/2, 1/2), both trainable."""

    def loss_fn(rt: Runtime, batch: dict[str, torch.Tensor], names, weights):
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        rows = torch.ones(ids.shape[0], 1, device=ids.device)
        full = rt.model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        with rt.adapted.context.use(("global",), rows, trainable=("global",)):
            glob = rt.model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        loss = (1 - gamma) * full.loss + gamma * glob.loss
        extra: dict[str, float] = {}
        if ids.shape[0] >= 2 and mu > 0:  # CKA needs a centred sample of at least 2 rows
            with torch.no_grad(), rt.adapted.context.use(("received",), rows, trainable=()):
                ref = rt.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            x = mean_pool(glob.hidden_states[-1], mask)
            y = mean_pool(full.hidden_states[-1], mask)
            z = mean_pool(ref.hidden_states[-1], mask).detach()
            contrast = linear_cka(x, y) - linear_cka(x, z)
            loss = loss + mu * contrast
            extra["cka_contrast"] = float(contrast.detach())
        return loss, extra

    return loss_fn


class FedMCPClient(ClientAlgorithm):
    """Client of FedMCP: both adapters trained together; uploads the global one."""

    def __init__(self, gamma: float = 0.5, mu: float = 0.05) -> None:
        if not 0 <= gamma <= 1 or mu < 0:
            raise ValueError(f"FedMCP needs gamma in [0, 1] and mu >= 0, got {gamma}, {mu}")
        self.gamma, self.mu = gamma, mu

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        rt = ctx.runtime
        rt.set("global", ins.state)
        rt.set("received", ins.state)
        rt.set("local", ctx.private.get("local") or fresh_local(ctx))
        res = train_adapters(rt, rt.examples(ctx.data), ["global", "local"], ["global", "local"], [0.5, 0.5],
                             seed=derive_seed(ctx.seed, ins.round, ctx.client_id, "mcp"),
                             loss_fn=fedmcp_loss(self.gamma, self.mu), desc=f"r{ins.round} {ctx.client_id} mcp",
                             round_idx=ins.round)
        ctx.private["local"] = rt.get("local")
        return FitRes(ctx.client_id, rt.get("global"), len(ctx.data.train), res.metrics())


def _strategy(o: Mapping[str, Any]) -> Strategy:
    return FedAvgStrategy(seed=int(o.get("seed", 0)), weighting="equal")


FEDMCP = Method(
    name="fedmcp", strategy=_strategy,
    client=lambda o: FedMCPClient(gamma=float(o.get("gamma", 0.5)), mu=float(o.get("mu", 0.05))),
    has_local=True, inference_weight=0.5, defaults={"gamma": 0.5, "mu": 0.05}, regime=REGIME,
)
