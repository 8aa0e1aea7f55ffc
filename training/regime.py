"""Each method's paper training regime, and the budgets (presets) that scale it without changing it.

A :class:`Regime` is how a method's paper trains its clients: optimizer, learning rate, its schedule
inside a local run and its decay from round to round, batch size, local epochs or steps, rounds. Each
method module defines its own (``REGIME``) beside its client and server halves and registers it on its
:class:`training.protocol.Method`; the values and where each comes from are in the README table
"Training settings per method".

A :class:`Budget` (``--preset``) scales how much of that regime a run can afford: fewer rounds, a cap
on the optimizer steps of each local run, a cap on the batch size, a shorter token cutoff. It never
changes the optimizer, learning rate, schedule or decay, so ``small`` FedAMoLE is still Adam 5e-5
decayed x0.99 per round at batch 1, only shorter. Options that count rounds (pFedSeq's warm-up ``W``)
are scaled with the rounds, so a short run still leaves rounds after the warm-up.

This module imports nothing of ours: :mod:`training.protocol` and :mod:`training.runtime` both use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("linear", "constant")


@dataclass(frozen=True)
class Regime:
    """A method's client training as its paper (or, where the paper is silent, its reference code) runs it.

    Attributes:
        optimizer: ``adamw``, ``adam`` or ``sgd``; a new optimizer for every local run.
        lr: the learning rate of round 0.
        schedule: inside one local run, ``linear`` decay to 0 (HF Trainer's default, the FedDPA
            reference) or ``constant``.
        round_decay: the learning rate of round r is ``lr * round_decay ** r`` (FedAMoLE: 0.99).
        batch_size: examples per optimizer step.
        local_epochs: passes over the local data per round (when ``max_steps`` is None).
        max_steps: optimizer steps per round instead of epochs (FedAMoLE: 200); None: epochs decide.
        rounds: communication rounds.
        round_options: method options that count rounds and scale with the budget's rounds.
        source: where the numbers come from (paper section, or reference code where the paper is silent).
    """

    optimizer: str = "adamw"
    lr: float = 3e-4
    schedule: str = "linear"
    round_decay: float = 1.0
    batch_size: int = 32
    local_epochs: int = 10
    max_steps: int | None = None
    rounds: int = 20
    round_options: tuple[str, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS or self.schedule not in SCHEDULES:
            raise ValueError(f"regime needs optimizer in {OPTIMIZERS} and schedule in {SCHEDULES}, "
                             f"got {self.optimizer!r}, {self.schedule!r}")
        if not self.lr > 0 or not 0 < self.round_decay <= 1:
            raise ValueError(f"regime needs lr > 0 and round_decay in (0, 1], got {self.lr}, {self.round_decay}")
        if min(self.batch_size, self.local_epochs, self.rounds) < 1 or (self.max_steps is not None
                                                                         and self.max_steps < 1):
            raise ValueError(f"regime needs batch_size, local_epochs, rounds, max_steps >= 1: {self}")

    def asdict(self) -> dict[str, Any]:
        """JSON-ready values (``round_options`` as a list)."""
        out = asdict(self)
        out["round_options"] = list(self.round_options)
        return out


# FedDPA's (paper 000 section 5.1: batch 32, 10 local epochs, 20 rounds; lr, AdamW and the linear decay are
# the reference code's HF Trainer, METHODS.md 2.3): the regime of every method without its own.
FEDDPA_REGIME = Regime(source="paper 000 s5.1 + App. (batch 32, 10 epochs, K=20); lr/AdamW/linear: reference code")
# Paper 000 App. B: the Local and Centralized baselines train 50 epochs, without communication rounds.
BASELINE_REGIME = Regime(local_epochs=50, rounds=1, source="paper 000 App. B (50 epochs, one run); lr/AdamW: "
                         "reference code")


@dataclass(frozen=True)
class Budget:
    """How much of a regime a run affords (``--preset``); the regime's optimizer, lr and schedule stay.

    Attributes:
        rounds_scale: rounds = max(min_rounds, ceil(regime rounds * rounds_scale)), at most the regime's.
        min_rounds: the fewest rounds a scaled run gets.
        max_steps: cap on optimizer steps per local run (None: the regime's epochs or steps).
        max_batch: cap on the batch size (None: the regime's).
        micro_batch_size: examples per forward (gradient accumulation up to the batch size).
        cutoff_len: token cutoff per example.
    """

    rounds_scale: float = 1.0
    min_rounds: int = 1
    max_steps: int | None = None
    max_batch: int | None = None
    micro_batch_size: int = 8
    cutoff_len: int = 512

    def rounds(self, regime: Regime) -> int:
        """The rounds of ``regime`` under this budget."""
        if self.rounds_scale >= 1:
            return regime.rounds
        # never more rounds than the paper's (the non-federated baselines train in one)
        return min(regime.rounds, max(self.min_rounds, math.ceil(regime.rounds * self.rounds_scale)))

    def scale_option(self, value: int) -> int:
        """A round-counting option (pFedSeq's warm-up) scaled like the rounds."""
        if self.rounds_scale >= 1:
            return value
        return max(1, math.ceil(value * self.rounds_scale))


BUDGETS: dict[str, Budget] = {
    "paper": Budget(),
    # One GPU hour for the whole suite; a long afternoon on a CPU per method with SmolLM2.
    "medium": Budget(rounds_scale=0.25, min_rounds=3, max_steps=24, max_batch=16, cutoff_len=256),
    # Minutes per method on a 2-core CPU with SmolLM2.
    "small": Budget(rounds_scale=0.1, min_rounds=2, max_steps=6, max_batch=8, cutoff_len=192),
    # Smoke runs and tests with the tiny random model.
    "tiny": Budget(rounds_scale=0.1, min_rounds=2, max_steps=2, max_batch=4, micro_batch_size=2, cutoff_len=128),
}


def budget(name: str) -> Budget:
    """A named budget.

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    if name not in BUDGETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(BUDGETS)}")
    return BUDGETS[name]


def train_fields(regime: Regime, name: str) -> dict[str, Any]:
    """The :class:`training.runtime.TrainConfig` fields of ``regime`` under budget ``name``."""
    b = budget(name)
    steps = regime.max_steps
    if b.max_steps is not None:
        steps = b.max_steps if steps is None else min(steps, b.max_steps)
    batch = regime.batch_size if b.max_batch is None else min(regime.batch_size, b.max_batch)
    return {"optimizer": regime.optimizer, "lr": regime.lr, "schedule": regime.schedule,
            "round_decay": regime.round_decay, "batch_size": batch, "micro_batch_size": min(b.micro_batch_size, batch),
            "local_epochs": regime.local_epochs, "max_steps": steps, "cutoff_len": b.cutoff_len}


def scaled_options(regime: Regime, name: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The method's default options with its round-counting ones scaled to budget ``name``."""
    b = budget(name)
    return {k: (b.scale_option(int(v)) if k in regime.round_options else v) for k, v in defaults.items()}
