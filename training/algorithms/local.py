"""Local (no communication) and FedLoRA / FedIT-FT (global by FedIT, then a local fine-tune).

Local: each client trains its own adapter on its own data every round and shares nothing (the
isolated baseline of papers 000 and 002). FedLoRA (called FedIT-FT in paper 002): FedIT rounds, then
each client fine-tunes a copy of the final global adapter on its data; that copy is its personalized
model. FedDPA-F (paper 000, section 4.2) trains exactly like FedLoRA and differs at inference.
"""

from __future__ import annotations

from training.algorithms.fedit import FEDAVG_OPTIONS, FedAvgClient, FedAvgStrategy
from training.local.regime import BASELINE_REGIME, FEDDPA_REGIME
from training.local.runtime import Runtime
from training.local.train import train_adapters
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method, Strategy
from training.state import StateDict, derive_seed


class NoServer(Strategy):
    """Server of the Local baseline: nothing is sent, nothing aggregated."""

    def initial_state(self, runtime: Runtime) -> StateDict:
        return {}

    def aggregate(self, round_idx: int, results: list[FitRes], failures: list[tuple[str, str]],
                  state: StateDict) -> StateDict | None:
        return None


def train_local(ctx: ClientContext, round_idx: int, start: StateDict, names: tuple[str, ...] = ("local",),
                weights: tuple[float, ...] = (1.0,), phase: str = "local") -> dict[str, float]:
    """Train the client's ``local`` adapter from ``start``; keep it in ``ctx.private``."""
    rt = ctx.runtime
    rt.set("local", start)
    res = train_adapters(rt, rt.examples(ctx.data), ["local"], names, weights,
                         seed=derive_seed(ctx.seed, round_idx, ctx.client_id, phase),
                         desc=f"r{round_idx} {ctx.client_id} {phase}", round_idx=round_idx)
    ctx.private["local"] = rt.get("local")
    return {f"{phase}_{k}": v for k, v in res.metrics().items()}


def fresh_local(ctx: ClientContext) -> StateDict:
    """A new local adapter (PEFT init, B = 0) seeded by the client."""
    return ctx.runtime.fresh("local", derive_seed(ctx.seed, "local-init", ctx.client_id))


class LocalClient(ClientAlgorithm):
    """Client of the Local baseline: keep training the private adapter, upload nothing."""

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        start = ctx.private.get("local") or fresh_local(ctx)
        metrics = train_local(ctx, ins.round, start)
        return FitRes(ctx.client_id, {}, len(ctx.data.train), {"loss": metrics["local_loss"]})


class FineTuneClient(FedAvgClient):
    """FedIT during the rounds; at the end, fine-tune a copy of the final global locally."""

    def finalize(self, state: StateDict, ctx: ClientContext) -> dict[str, float]:
        return train_local(ctx, round_idx=-1, start=state, phase="finetune")


LOCAL = Method(name="local", strategy=lambda o: NoServer(), client=lambda o: LocalClient(),
               has_local=True, inference_weight=1.0, regime=BASELINE_REGIME)
FEDLORA = Method(name="fedlora", strategy=FedAvgStrategy.from_options, client=lambda o: FineTuneClient(),
                 regime=FEDDPA_REGIME, has_local=True, inference_weight=1.0, options=FEDAVG_OPTIONS)
