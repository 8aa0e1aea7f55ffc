"""FedIT (FedAvg of one LoRA, Zhang et al. 2024) and FedProx (Li et al. 2020): the global baselines.

Each selected client starts from the received global adapter, trains it alone on its data, and
uploads it; the server averages, with equal client weights by default (the FedDPA papers aggregate
"based on client number", docs/methods.md 2.2) or by ``num_examples``; the options ``clip_norm``,
``aggregator`` and ``trim`` turn on robust aggregation (:mod:`training.federation.robust`) for every method
built on this strategy (FedIT, FedProx, FedLoRA, FedDPA, FedOA, FedMCP, FedAvgM; each builds it with
:meth:`FedAvgStrategy.from_options`). FedProx adds ``mu/2 ||theta -
theta_g||^2`` to the client loss; ``mu = 0`` is FedIT exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Self, cast

import torch

from training.federation.aggregate import Weighting, aggregate_results
from training.federation.robust import OPTIONS as ROBUST_OPTIONS
from training.federation.robust import RobustConfig, robust_aggregate
from training.local.regime import BASELINE_REGIME, FEDDPA_REGIME
from training.local.runtime import Runtime
from training.local.train import LossFn, length_grouped, lm_loss, train_adapters
from training.options import Option
from training.protocol import ClientAlgorithm, ClientContext, FitIns, FitRes, Method, Strategy
from training.state import StateDict, derive_seed


class FedAvgStrategy(Strategy):
    """Server: a fresh global adapter at start, FedAvg of the uploads every round (or a robust combination)."""

    def __init__(self, seed: int = 0, weighting: Weighting = "equal", robust: RobustConfig | None = None) -> None:
        if weighting not in ("equal", "num_examples"):
            raise ValueError(f"weighting must be 'equal' or 'num_examples', got {weighting!r}")
        self.seed = seed
        self.weighting = weighting
        self.robust = robust or RobustConfig()

    @classmethod
    def from_options(cls, options: Mapping[str, Any], **fixed: Any) -> Self:
        """The strategy under a method's options: ``seed``, ``weighting`` (default ``equal``) and robust
        aggregation (``clip_norm``, ``aggregator``, ``trim``; :meth:`RobustConfig.from_options`).

        Args:
            options: the method's options.
            **fixed: a subclass's own arguments, or a setting the method does not leave to the options.
        """
        return cls(**{"seed": int(options.get("seed", 0)), "weighting": options.get("weighting", "equal"),
                      "robust": RobustConfig.from_options(options), **fixed})

    def average(self, results: list[FitRes], state: StateDict) -> StateDict | None:
        """The uploads combined: the plain weighted average, or :mod:`training.federation.robust`'s when it is on."""
        if not self.robust.active:
            return aggregate_results(results, self.weighting)
        weights = [1.0 if self.weighting == "equal" else float(r.num_examples) for r in results]
        return robust_aggregate(results, state, weights, self.robust)

    def initial_state(self, runtime: Runtime) -> StateDict:
        return runtime.fresh("global", derive_seed(self.seed, "global-init"))

    def aggregate(self, round_idx: int, results: list[FitRes], failures: list[tuple[str, str]],
                  state: StateDict) -> StateDict | None:
        return self.average(results, state)

    def summary(self) -> dict[str, Any]:
        robust = {"robust": self.robust.__dict__} if self.robust.active else {}
        return {"aggregation": self.weighting, **robust}


def train_global(ins: FitIns, ctx: ClientContext, loss_fn: LossFn = lm_loss) -> tuple[StateDict, dict[str, float]]:
    """Train the received global adapter alone on the client's data; return it and the metrics."""
    rt = ctx.runtime
    rt.set("global", ins.state)
    res = train_adapters(rt, rt.examples(ctx.data), ["global"], ["global"], [1.0],
                         seed=derive_seed(ctx.seed, ins.round, ctx.client_id, "global"),
                         loss_fn=loss_fn, desc=f"r{ins.round} {ctx.client_id} global", round_idx=ins.round)
    return rt.get("global"), res.metrics()


class FedAvgClient(ClientAlgorithm):
    """Client: train the global adapter from what was received, upload it (FedProx when mu > 0)."""

    def __init__(self, mu: float = 0.0) -> None:
        if mu < 0:
            raise ValueError(f"FedProx mu must be >= 0, got {mu}")
        self.mu = mu

    def loss(self, received: Mapping[str, torch.Tensor]) -> LossFn:
        """The LM loss plus FedProx's proximal term toward the received global adapter."""
        if self.mu == 0:
            return lm_loss
        on_device: dict[str, torch.Tensor] = {}  # the received tensors, copied to the model's device once

        @length_grouped  # the proximal term is the step's: its row shares sum to one however rows are grouped
        def prox(rt: Runtime, batch: dict[str, torch.Tensor], names, weights):
            loss, extra = lm_loss(rt, batch, names, weights)
            params = rt.params("global")
            if not on_device:
                on_device.update({k: received[k].to(device=params[k].device, dtype=params[k].dtype) for k in params})
            # a tensor: the global adapter has parameters, so sum never returns its start 0
            term = cast(torch.Tensor, sum(((params[k] - on_device[k]) ** 2).sum() for k in params))
            return loss + 0.5 * self.mu * term, {**extra, "prox": float(term.detach())}

        return prox

    def fit(self, ins: FitIns, ctx: ClientContext) -> FitRes:
        state, metrics = train_global(ins, ctx, self.loss(ins.state))
        return FitRes(ctx.client_id, state, len(ctx.data.train), metrics)


WEIGHTING = Option("weighting", str, "equal", "client weights in the average", choices=("equal", "num_examples"))
# the options FedAvgStrategy.from_options reads: every method whose server half it builds declares them
FEDAVG_OPTIONS = (WEIGHTING, *ROBUST_OPTIONS)


def mu_option(default: float) -> Option:
    """FedProx's proximal weight ``mu`` (0: plain FedAvg local training)."""
    return Option("mu", float, default, "FedProx proximal term weight toward the received global", low=0)


FEDIT = Method(name="fedit", strategy=FedAvgStrategy.from_options, client=lambda o: FedAvgClient(mu=0.0),
               regime=FEDDPA_REGIME, options=FEDAVG_OPTIONS)
FEDPROX = Method(name="fedprox", strategy=FedAvgStrategy.from_options,
                 client=lambda o: FedAvgClient(mu=float(o.get("mu", 0.01))), regime=FEDDPA_REGIME,
                 options=(WEIGHTING, mu_option(0.01), *ROBUST_OPTIONS))
CENTRALIZED = Method(name="centralized", strategy=FedAvgStrategy.from_options, client=lambda o: FedAvgClient(mu=0.0),
                     centralized=True, regime=BASELINE_REGIME,
                     options=(replace(WEIGHTING, listed=False), *ROBUST_OPTIONS))
