"""Each method's paper training regime, and the budgets (presets) that take a fixed share of it.

A :class:`Regime` is how a method's paper trains its clients: optimizer, learning rate, its schedule
inside a local run and its decay from round to round, batch size, local epochs or steps, rounds. Each
method module defines its own (``REGIME``) beside its client and server halves and registers it on its
:class:`training.protocol.Method`; the values and where each comes from are in docs/training.md
"Training settings per method".

A :class:`Budget` (``--preset``) is a *fraction* ``f`` of the paper's work, applied the same way to every
method, so the ratios between methods survive (FedDPA's 10 epochs : FedOA's 2 : FedMCP's 1; Local and
Centralized's 50; FedAMoLE's 200 steps). The rules, written once here:

* **Examples per client.** A method's examples seen per client over the run are ``f`` times the
  paper's (within one optimizer step per local run of rounding).
* **Rounds and local work scale together**: rounds ``R' = clamp(round(R * f ** 0.5), min_rounds, R)``
  and each local run keeps the rest, ``E' = E * f * R / R'`` epochs (or ``max_steps * f * R / R'`` steps),
  which may be a fraction of an epoch: ``--print-config`` shows it per method.
* **Learning rate.** ``lr' = lr * min(LR_CAP, sqrt(S / S'))`` with ``S / S' = B' / (f B)`` the ratio of
  the paper's optimizer steps per client to the budget's. The reasoning: with noisy gradients an Adam/SGD
  trajectory's displacement grows like ``lr * sqrt(steps)``, so this keeps it; LR_CAP = 10 is a guard
  against divergence, not tuned. This is the default *rule*, not a tuned value: ``fedmosaic train
  --lr-search`` chooses a multiple of it per method and budget on a validation split carved from each
  client's training data (:mod:`training.lr_search`), never the test set, and run.json records it.
* **Schedule.** A run shorter than the paper's replaces the linear decay to 0 (which spends half of a
  6-step run below half the rate) by a warm-up over the first ``WARMUP_SHARE`` of the steps then a cosine
  to ``COSINE_FLOOR`` of the peak (``cosine``); constant schedules stay constant.
* The batch is capped (``max_batch``); the cutoff (512) keeps every training example of FedDPA data
  sets 1 and 2 (the longest, a hellaswag example of data set 2, is 470 SmolLM2 tokens).

Options that count rounds (pFedSeq's warm-up ``W``) are scaled like the rounds. ``tiny`` (tests with the
random tiny model) also caps the optimizer steps of a run, which no other preset does.

This module imports nothing of ours: :mod:`training.protocol` and :mod:`training.local.runtime` both use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("linear", "constant", "cosine")
LR_CAP = 10.0  # the largest multiple of a paper's lr the step rule gives (a divergence guard, not tuned)
WARMUP_SHARE = 0.1  # ``cosine``: the first 10 % of a run's steps (rounded down) warm up linearly
COSINE_FLOOR = 0.1  # ``cosine``: decays to 10 % of the peak, not to 0 (a short run keeps learning to its end)
# The examples per client of FedDPA's data sets (paper 000 App. A.1: 300 per task), used only to show
# ``--print-config``'s examples and steps before any data set is loaded.
NOMINAL_EXAMPLES = 300


def schedule_factor(kind: str, step: int, total: int) -> float:
    """The multiplier of the peak lr at optimizer step ``step`` (0-based) of a ``total``-step run."""
    if kind == "constant":
        return 1.0
    if kind == "linear":  # HF Trainer's default without warm-up (the FedDPA reference)
        return max(0.0, 1.0 - step / total)
    if kind != "cosine":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    warm = int(WARMUP_SHARE * total)
    if step < warm:
        return (step + 1) / (warm + 1)
    span = max(1, total - warm - 1)
    progress = min(1.0, (step - warm) / span)
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


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

    def run_examples(self, n: int = NOMINAL_EXAMPLES) -> float:
        """Examples one local run of the paper passes over, for a client with ``n`` examples."""
        return float(self.max_steps * self.batch_size) if self.max_steps is not None else float(self.local_epochs * n)

    def asdict(self) -> dict[str, Any]:
        """JSON-ready values (``round_options`` as a list)."""
        out = asdict(self)
        out["round_options"] = list(self.round_options)
        return out


# FedDPA's (paper 000 section 5.1: batch 32, 10 local epochs, 20 rounds; lr, AdamW and the linear decay are
# the reference code's HF Trainer, docs/methods.md 2.3): the regime of every method without its own.
FEDDPA_REGIME = Regime(source="paper 000 s5.1 + App. (batch 32, 10 epochs, K=20); lr/AdamW: reference code")
# Paper 000 App. B: the Local and Centralized baselines train 50 epochs, without communication rounds.
BASELINE_REGIME = Regime(local_epochs=50, rounds=1, source="paper 000 App. B (50 epochs, one run); lr/AdamW: "
                         "reference code")


@dataclass(frozen=True)
class Budget:
    """A fraction of every method's paper work (``--preset``); the rules are the module docstring's.

    Attributes:
        fraction: ``f``, the share of the paper's examples per client each method sees.
        min_rounds: the fewest rounds a federated method gets (never more than its paper's).
        max_batch: cap on the batch size (None: the regime's).
        micro_batch_size: examples per forward (gradient accumulation up to the batch size).
        cutoff_len: token cutoff per example.
        max_steps: a cap on the optimizer steps of a local run (``tiny`` only: smoke runs; it breaks the
            proportions, so no other preset has one).
    """

    fraction: float = 1.0
    min_rounds: int = 2
    max_batch: int | None = None
    micro_batch_size: int = 8
    cutoff_len: int = 512
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1 or self.min_rounds < 1:
            raise ValueError(f"a budget needs fraction in (0, 1] and min_rounds >= 1, got {self}")

    def rounds(self, regime: Regime) -> int:
        """The rounds of ``regime`` under this budget."""
        if self.fraction >= 1:
            return regime.rounds
        return min(regime.rounds, max(self.min_rounds, math.floor(regime.rounds * math.sqrt(self.fraction) + 0.5)))

    def local_scale(self, regime: Regime) -> float:
        """How much of one paper local run a budget's local run is (``f * R / R'``)."""
        return self.fraction * regime.rounds / self.rounds(regime)

    def batch(self, regime: Regime) -> int:
        """The regime's batch size under the cap."""
        return regime.batch_size if self.max_batch is None else min(regime.batch_size, self.max_batch)

    def lr_factor(self, regime: Regime) -> float:
        """The step rule's multiple of the paper's lr: ``min(LR_CAP, sqrt(B' / (f B)))``."""
        if self.fraction >= 1 and self.batch(regime) == regime.batch_size:
            return 1.0
        return min(LR_CAP, math.sqrt(self.batch(regime) / (self.fraction * regime.batch_size)))

    def scale_option(self, value: int, regime: Regime) -> int:
        """A round-counting option (pFedSeq's warm-up) scaled like the rounds."""
        if self.fraction >= 1:
            return value
        return max(1, math.floor(value * self.rounds(regime) / regime.rounds + 0.5))


BUDGETS: dict[str, Budget] = {
    "paper": Budget(),
    # About a GPU hour per method with SmolLM2 (FedDPA-T: 3,750 + 3,750 examples per client).
    "medium": Budget(fraction=1 / 16, max_batch=16),
    # Sized for ``fedmosaic reproduce`` (fedmosaic/reproduce/table1.py): one method's training plus a full
    # evaluation of FedDPA data set 1 in about 30 minutes on 2 CPU cores (docs/reproduction.md has
    # the arithmetic).
    "repro": Budget(fraction=1 / 200, max_batch=8),
    # A first look in minutes per method on a 2-core CPU.
    "small": Budget(fraction=1 / 400, max_batch=8),
    # Smoke runs and tests with the tiny random model.
    "tiny": Budget(fraction=1 / 400, max_batch=4, micro_batch_size=2, cutoff_len=128, max_steps=2),
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
    """The :class:`training.local.runtime.TrainConfig` fields of ``regime`` under budget ``name``."""
    b = budget(name)
    batch = b.batch(regime)
    scale = b.local_scale(regime)
    epochs: float = regime.local_epochs
    steps = regime.max_steps
    if b.fraction < 1:
        if steps is not None:
            steps = max(1, math.floor(steps * scale + 0.5))
        else:
            epochs = round(regime.local_epochs * scale, 6)
    if b.max_steps is not None:
        steps = b.max_steps if steps is None else min(steps, b.max_steps)
    schedule = "cosine" if b.fraction < 1 and regime.schedule == "linear" else regime.schedule
    return {"optimizer": regime.optimizer, "lr": regime.lr * b.lr_factor(regime), "schedule": schedule,
            "round_decay": regime.round_decay, "batch_size": batch, "micro_batch_size": min(b.micro_batch_size, batch),
            "local_epochs": epochs, "max_steps": steps, "cutoff_len": b.cutoff_len}


def run_steps(n: int, batch_size: int, local_epochs: float, max_steps: int | None) -> int:
    """Optimizer steps of one local run over ``n`` examples (whole epochs: ceil(n / B) each, as HF's Trainer)."""
    if max_steps is not None:
        return max_steps
    if float(local_epochs).is_integer():
        return math.ceil(n / batch_size) * int(local_epochs)
    return max(1, math.ceil(n * local_epochs / batch_size))


def scaled_options(regime: Regime, name: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The method's default options with its round-counting ones scaled to budget ``name``."""
    b = budget(name)
    return {k: (b.scale_option(int(v), regime) if k in regime.round_options else v) for k, v in defaults.items()}
