"""LoRA configuration: rank, alpha, dropout, target modules, rsLoRA (LoRA paper, Hu et al. 2021, s4.1).

A frozen dataclass validated on construction. ``scaling`` is ``alpha / r`` (LoRA section 4.1) or
``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023), exactly as PEFT computes it, so adapters saved
here load in PEFT with identical outputs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


class AdapterError(ValueError):
    """An adapter, its file or its weights do not fit the model or are malformed."""


@dataclass(frozen=True)
class LoraConfig:
    """Hyper-parameters of one LoRA adapter.

    Attributes:
        r: rank (the inner dimension of ``B A``); FedDPA/FedAMoLE use 8.
        alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (16 / 8 = 2 in the papers).
        dropout: dropout on the adapter's input during training (0.05 in the papers).
        target_modules: names of the Linear modules to adapt (suffix match, as PEFT).
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = field(default=("q_proj", "v_proj"))
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str | list):
            names = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
            object.__setattr__(self, "target_modules", tuple(names))
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise AdapterError(f"LoraConfig.r must be a positive integer, got {self.r!r}")
        if not math.isfinite(float(self.alpha)) or self.alpha <= 0:
            raise AdapterError(f"LoraConfig.alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise AdapterError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise AdapterError(
                f"LoraConfig.target_modules must be non-empty module names, got {self.target_modules!r}"
            )

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
            "target_modules": sorted(self.target_modules),
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
        """Build a config from PEFT's ``adapter_config.json``, refusing what we cannot apply."""
        if data.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"only LoRA adapters are supported, got peft_type={data.get('peft_type')!r}")
        for flag, wrong in (("use_dora", True), ("fan_in_fan_out", True), ("lora_bias", True)):
            if data.get(flag) == wrong:
                raise AdapterError(f"adapter_config.json sets {flag}={wrong}, which fedmosaic does not support")
        if data.get("bias", "none") != "none":
            raise AdapterError(f"adapter_config.json sets bias={data['bias']!r}; only 'none' is supported")
        if data.get("rank_pattern") or data.get("alpha_pattern"):
            raise AdapterError("adapter_config.json uses rank_pattern/alpha_pattern, which fedmosaic does not support")
        targets = data.get("target_modules")
        if isinstance(targets, str):
            raise AdapterError(f"target_modules as a regex ({targets!r}) is not supported; list the module names")
        return cls(
            r=int(data["r"]),
            alpha=float(data.get("lora_alpha", 8)),
            dropout=float(data.get("lora_dropout", 0.0)),
            target_modules=tuple(targets or ("q_proj", "v_proj")),
            use_rslora=bool(data.get("use_rslora", False)),
        )

    def asdict(self) -> dict[str, Any]:
        """Return the fields as plain Python values (for run configs)."""
        out = asdict(self)
        out["target_modules"] = list(self.target_modules)
        return out
