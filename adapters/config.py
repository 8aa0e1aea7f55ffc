"""LoRA configuration: rank, alpha, dropout, target modules, rsLoRA (LoRA paper, Hu et al. 2021, s4.1).

A frozen dataclass validated on construction. ``scaling`` is ``alpha / r`` (LoRA section 4.1) or
``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023), exactly as PEFT computes it, so adapters saved
here load in PEFT with identical outputs.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any


class AdapterError(ValueError):
    """An adapter, its file or its weights do not fit the model or are malformed."""


ALL_LINEAR = "all-linear"
# PEFT's target_modules: module names (suffix match), a regex over the module path, or all-linear
Targets = tuple[str, ...] | str


def check_targets(spec: object) -> Targets:
    """``spec`` as a target spec: a list becomes a tuple of names, ``all-linear`` (any case) is kept, a
    string is a regular expression that must compile (:mod:`adapters.targets` has the matching rules).

    Raises:
        AdapterError: empty, a name that is not a non-empty string, or a regex that does not compile.
    """
    if isinstance(spec, str):
        if spec.lower() == ALL_LINEAR:
            return ALL_LINEAR
        try:
            re.compile(spec)
        except re.error as exc:
            raise AdapterError(f"target_modules {_shown(spec)} is not a valid regular expression: {exc}") from exc
        if not spec:
            raise AdapterError("target_modules must not be empty")
        return spec
    names = tuple(spec) if isinstance(spec, list | tuple) else None
    if not names or not all(isinstance(t, str) and t for t in names):
        raise AdapterError(f"target_modules must be module names, a regex or 'all-linear', got {_shown(spec)}")
    return names


@dataclass(frozen=True)
class LoraConfig:
    """Hyper-parameters of one LoRA adapter.

    Attributes:
        r: rank (the inner dimension of ``B A``); FedDPA/FedAMoLE use 8.
        alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (16 / 8 = 2 in the papers).
        dropout: dropout on the adapter's input during training (0.05 in the papers).
        target_modules: the Linear modules to adapt, as PEFT's: names (a path equal to one or ending in
            ``.name``), a regular expression matched against the whole module path, or ``all-linear``
            (every Linear but the output layer); :mod:`adapters.targets`.
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: Targets = field(default=("q_proj", "v_proj"))
    use_rslora: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "target_modules", check_targets(self.target_modules))
        except AdapterError as exc:
            raise AdapterError(f"LoraConfig.{exc}") from None
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise AdapterError(f"LoraConfig.r must be a positive integer, got {self.r!r}")
        if not math.isfinite(float(self.alpha)) or self.alpha <= 0:
            raise AdapterError(f"LoraConfig.alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise AdapterError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def scaling(self) -> float:
        """The factor ``s`` in ``y = W0 x + s B A x``."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def to_peft_dict(self, base_model: str | None = None) -> dict[str, Any]:
        """Return the ``adapter_config.json`` content PEFT expects for this adapter."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.target_modules if isinstance(self.target_modules, str)
            else sorted(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "modules_to_save": None,
            "use_dora": False,
            "lora_bias": False,
        }

    @classmethod
    def from_peft_dict(cls, data: dict[str, Any]) -> LoraConfig:
        """Build a config from PEFT's ``adapter_config.json``, refusing what we cannot apply.

        Every field is type-checked as it is read (``r`` a positive integer, never a truncated float;
        ``lora_alpha`` and ``lora_dropout`` numbers; ``target_modules`` a list of module names), so a
        wrongly typed file is an AdapterError naming the field, never a TypeError.

        Raises:
            AdapterError: an unsupported option or a field of the wrong type or range (named).
        """
        if data.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"only LoRA adapters are supported, got peft_type={_shown(data.get('peft_type'))}")
        for flag, wrong in (("use_dora", True), ("fan_in_fan_out", True), ("lora_bias", True)):
            if data.get(flag) == wrong:
                raise AdapterError(f"adapter_config.json sets {flag}={wrong}, which fedmosaic does not support")
        if data.get("bias", "none") != "none":
            raise AdapterError(f"adapter_config.json sets bias={_shown(data['bias'])}; only 'none' is supported")
        if data.get("rank_pattern") or data.get("alpha_pattern"):
            raise AdapterError("adapter_config.json uses rank_pattern/alpha_pattern, which fedmosaic does not support")
        for unsupported in ("layers_to_transform", "exclude_modules", "modules_to_save", "target_parameters"):
            if data.get(unsupported):
                raise AdapterError(f"adapter_config.json sets {unsupported}={_shown(data[unsupported])}, which "
                                   "fedmosaic does not support")
        rank = data.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterError(f"adapter_config.json field 'r' must be a positive integer, got {_shown(rank)}")
        targets = data.get("target_modules")
        names = isinstance(targets, list) and all(isinstance(t, str) and t for t in targets)
        if targets is not None and not names and not (isinstance(targets, str) and targets):
            raise AdapterError(f"adapter_config.json field 'target_modules' must be a list of module names, a "
                               f"regular expression or 'all-linear', got {_shown(targets)}")
        rslora = data.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise AdapterError(f"adapter_config.json field 'use_rslora' must be true or false, got {_shown(rslora)}")
        return cls(
            r=rank,
            alpha=_number(data, "lora_alpha", 8.0),
            dropout=_number(data, "lora_dropout", 0.0),
            target_modules=targets if isinstance(targets, str) else tuple(targets or ("q_proj", "v_proj")),
            use_rslora=rslora,
        )

    def asdict(self) -> dict[str, Any]:
        """Return the fields as plain Python values (for run configs)."""
        out = asdict(self)
        targets = self.target_modules
        out["target_modules"] = targets if isinstance(targets, str) else list(targets)
        return out


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a config field echoed in an error message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(data: dict[str, Any], field_name: str, default: float) -> float:
    """``data[field_name]`` as a finite float (``default`` when absent)."""
    value = data.get(field_name, default)
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and abs(value) < 1e300 else math.nan
    if not math.isfinite(number):
        raise AdapterError(f"adapter_config.json field {field_name!r} must be a number, got {_shown(value)}")
    return number
