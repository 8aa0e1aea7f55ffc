"""FedAvgM: FedAvg with server momentum (Hsu et al. 2019; the server-optimizer form of Reddi et al. 2021).

Clients are FedIT's: each trains the received global adapter alone and uploads it. The server takes the
average upload minus the current global adapter as a pseudo-gradient ``d`` and applies it with momentum,
``v <- momentum * v + d`` then ``theta <- theta + server_lr * v``; ``momentum = 0`` with ``server_lr = 1``
is FedAvg. Options: ``momentum`` (0.9), ``server_lr`` (1.0), ``weighting`` (``equal`` or ``num_examples``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from training.algorithms.fedit import FEDAVG_OPTIONS, FedAvgClient, FedAvgStrategy
from training.federation.aggregate import Weighting
from training.federation.robust import RobustConfig
from training.local.regime import FEDDPA_REGIME
from training.options import Option
from training.protocol import FitRes, Method
from training.state import StateDict


class FedAvgMStrategy(FedAvgStrategy):
    """Server: a fresh global adapter (as FedIT), then a momentum step along the averaged update each round."""

    def __init__(self, seed: int = 0, weighting: Weighting = "equal", momentum: float = 0.9,
                 server_lr: float = 1.0, robust: RobustConfig | None = None) -> None:
        super().__init__(seed=seed, weighting=weighting, robust=robust)
        if not 0.0 <= momentum < 1.0 or server_lr <= 0.0:
            raise ValueError(f"FedAvgM needs 0 <= momentum < 1 and server_lr > 0, got {momentum} and {server_lr}")
        self.momentum = momentum
        self.server_lr = server_lr
        self.velocity: StateDict = {}  # v per tensor: float32 on the CPU, beside the server's state

    def aggregate(self, round_idx: int, results: list[FitRes], failures: list[tuple[str, str]],
                  state: StateDict) -> StateDict | None:
        """The momentum step along the averaged upload; None (keep everything) when nobody uploaded."""
        average = self.average(results, state)
        if average is None:
            return None
        new: StateDict = {}
        for key, theta in state.items():
            step = average[key].double() - theta.double()
            v = self.momentum * self.velocity.get(key, torch.zeros_like(step)).double() + step
            self.velocity[key] = v.float()
            new[key] = (theta.double() + self.server_lr * v).to(theta.dtype)
        return new

    def state_dict(self) -> dict[str, Any]:
        """The velocity, checkpointed every round so that a resumed run continues it."""
        return {"velocity": dict(self.velocity)}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` on resume."""
        self.velocity = {key: v.float() for key, v in data["velocity"].items()}

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "momentum": self.momentum, "server_lr": self.server_lr}


def _strategy(o: Mapping[str, Any]) -> FedAvgMStrategy:
    return FedAvgMStrategy.from_options(o, momentum=float(o.get("momentum", 0.9)),
                                        server_lr=float(o.get("server_lr", 1.0)))


FEDAVGM = Method(name="fedavgm", strategy=_strategy, client=lambda o: FedAvgClient(mu=0.0), regime=FEDDPA_REGIME,
                 options=(Option("momentum", float, 0.9, "server momentum on the averaged update", low=0, high=1,
                                 open_high=True),
                          Option("server_lr", float, 1.0, "server learning rate on the update", low=0, open_low=True),
                          *FEDAVG_OPTIONS))
