"""A method's effective settings: its paper regime under a ``--preset`` budget, then the caller's overrides.

:func:`method_settings` is what ``fedmosaic train`` (:mod:`training.cli`) and the reproduction harness train
with; ``--print-config`` prints :meth:`MethodSettings.asdict`, and run.json records the budget's arithmetic
(:func:`budget_arithmetic`) beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from training.algorithms import get_method
from training.data import data_key
from training.local.regime import NOMINAL_EXAMPLES, budget, run_steps, scaled_options
from training.local.runtime import TrainConfig, preset

# method_settings override -> adapters.LoraConfig field (fedmosaic train --lora-r, ...; every method)
LORA_OVERRIDES = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}


@dataclass(frozen=True)
class MethodSettings:
    """A method's effective settings: its regime under a budget, with overrides.

    Attributes:
        method: the method's name.
        preset: the budget's name.
        train: local training settings.
        rounds: communication rounds.
        options: method options (defaults, round-counting ones scaled to the budget, then the user's).
        regime: the paper regime it started from (JSON).
        budget: the budget's arithmetic for a client of ``examples`` examples (:func:`budget_arithmetic`).
    """

    method: str
    preset: str
    train: TrainConfig
    rounds: int
    options: dict[str, Any]
    regime: dict[str, Any]
    budget: dict[str, Any]

    def asdict(self) -> dict[str, Any]:
        """JSON for ``--print-config``."""
        return {"method": self.method, "preset": self.preset, "rounds": self.rounds, "train": self.train.asdict(),
                "options": self.options, "regime": self.regime, "budget": self.budget}


def budget_arithmetic(method: str, preset_name: str, train: TrainConfig, rounds: int, examples: int) -> dict[str, Any]:
    """What a budget gives ``method`` per client of ``examples`` training examples, beside the paper's.

    ``examples_per_client`` counts one adapter's passes over the run (rounds x steps per run x batch):
    FedDPA-T and FedOA train their local adapter as much again, FedLoRA / FedDPA-F add one fine-tune run.
    """
    m = get_method(method)
    reg, b = m.regime, budget(preset_name)
    steps = run_steps(examples, train.batch_size, train.local_epochs, train.max_steps)
    paper_steps = run_steps(examples, reg.batch_size, reg.local_epochs, reg.max_steps)
    per_client = rounds * steps * train.batch_size
    paper = reg.rounds * paper_steps * reg.batch_size
    return {"fraction": b.fraction, "client_examples": examples, "epochs_per_run": round(steps * train.batch_size
                                                                                       / examples, 4),
            "steps_per_run": steps, "examples_per_client": per_client, "paper_examples_per_client": paper,
            "share_of_paper": round(per_client / paper, 5), "lr_rule_factor": round(b.lr_factor(reg), 4),
            "lr": train.lr, "schedule": train.schedule, "max_grad_norm": train.max_grad_norm}


def method_settings(method: str, preset_name: str = "paper", rounds: int | None = None,
                    options: Mapping[str, Any] | None = None, data: str | None = None, n_clients: int | None = None,
                    examples: int | None = None, **overrides: Any) -> MethodSettings:
    """``method``'s paper regime under budget ``preset_name``, with ``rounds``, option and field overrides.

    Args:
        method: a registered method name.
        preset_name: ``paper``, ``medium``, ``repro``, ``small`` or ``tiny``.
        rounds: communication rounds (None: the regime's, scaled by the budget).
        options: method options over its defaults.
        data: the data spec (a paper's per-data-set defaults: FedDPA-T's alpha 0.3 on ``feddpa2``, or on a
            folder holding its files: :func:`training.data.data_key`); None
            leaves such options out, for :func:`training.simulation.run_federated` to set.
        n_clients: the number of clients (defaults that scale with it: FedAMoLE's expert count); None
            leaves them out likewise.
        examples: training examples per client, for the budget arithmetic (None: 300, FedDPA's; the
            Centralized baseline pools 8 clients' worth).
        **overrides: :class:`training.local.runtime.TrainConfig` fields (None values are ignored); ``lr_decay``
            is ``round_decay``; ``max_grad_norm`` 0 turns clipping off; ``lora_r``, ``lora_alpha``,
            ``lora_dropout`` and ``target_modules`` (a spec, :mod:`adapters.targets`) set the LoRA config.
    """
    m = get_method(method)
    options = m.check_options(options or {})  # an undeclared key or a bad value: OptionError (a ValueError)
    if "lr_decay" in overrides:
        overrides["round_decay"] = overrides.pop("lr_decay")
    clip = overrides.pop("max_grad_norm", None)
    lora = {field: overrides.pop(key) for key, field in LORA_OVERRIDES.items() if overrides.get(key) is not None}
    for key in LORA_OVERRIDES:
        overrides.pop(key, None)
    train = preset(preset_name, m.regime, **overrides)
    if lora:  # an AdapterError (a ValueError) names a bad value
        train = replace(train, lora=replace(train.lora, **lora))
    if clip is not None:
        if clip < 0:
            raise ValueError(f"--max-grad-norm must be >= 0 (0 turns clipping off), got {clip}")
        train = replace(train, max_grad_norm=clip if clip > 0 else None)
    opts = scaled_options(m.regime, preset_name, m.options_for(data_key(data), n_clients=n_clients))
    # Defaults that depend on what is not known here are left to run_federated, which knows the data set
    # and its clients: passing the generic value on would override FedDPA-T's alpha 0.3 on feddpa2 or
    # FedAMoLE's expert count for the clients.
    unknown = [k for d in m.data_defaults.values() for k in d] if data is None else []
    unknown += list(m.client_defaults(1)) if n_clients is None and m.client_defaults else []
    opts = {**{k: v for k, v in opts.items() if k not in unknown}, **(options or {})}
    n = rounds if rounds is not None else budget(preset_name).rounds(m.regime)
    per_client = examples or NOMINAL_EXAMPLES * (8 if m.centralized else 1)
    return MethodSettings(m.name, preset_name, train, n, opts, m.regime.asdict(),
                          budget_arithmetic(m.name, preset_name, train, n, per_client))
