"""The client-side runtime: one frozen base model with the ``global`` and ``local`` adapter slots.

Simulated clients share one injected model; before a client trains, the runtime loads the tensors it
received (global) and its private ones (local) into the two slots. Tokenized examples are cached per
client. Training settings (the papers' values by default, a ``small`` preset for this CPU) are here.

The model lives on its device (CPU or GPU); what leaves it (:meth:`Runtime.get`, the uploads, the
server's state, the checkpoints) is on the CPU, so a run's messages and files never depend on where a
client trained, and a server on one device can drive clients on another.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from adapters import AdaptedModel, LoraConfig, inject
from models import LoadedModel
from models.loaded import check_compile_mode, compile_decoder_layers
from training.data import IGNORE, ClientData, Example, PromptConfig, tokenize_record
from training.local.regime import BUDGETS, FEDDPA_REGIME, OPTIMIZERS, SCHEDULES, Regime, train_fields
from training.state import StateDict

SLOTS = ("global", "local", "received")  # received: a frozen copy of the round's global (FedMCP)


@dataclass(frozen=True)
class TrainConfig:
    """Local training settings (FedDPA paper 000 section 5.1 / docs/methods.md 2.3 as defaults).

    A run's settings come from its method's :class:`training.local.regime.Regime` under a budget
    (:func:`training.settings.method_settings`); the defaults here are FedDPA's regime at the paper's budget.

    Attributes:
        lr: learning rate of round 0 (3e-4, AdamW, linear decay inside each local run, no warm-up).
        batch_size: examples per optimizer step (paper 32).
        micro_batch_size: examples per forward (gradient accumulation up to ``batch_size``).
        local_epochs: passes over the local data per round (paper 10); a budget may give a fraction of
            one (:mod:`training.local.regime`), then a run is ``ceil(n * local_epochs / batch_size)`` steps.
        max_steps: cap on optimizer steps per local run (None: epochs decide).
        cutoff_len: token cutoff per example (512).
        optimizer: ``adamw``, ``adam`` or ``sgd``.
        schedule: inside one local run, ``linear`` decay to 0, ``constant``, or ``cosine`` (a budget's:
            warm-up, then cosine to a floor; :func:`training.local.regime.schedule_factor`).
        round_decay: round r trains at ``lr * round_decay ** r`` (FedAMoLE 0.99; 1: no decay).
        weight_decay: AdamW weight decay (0).
        max_grad_norm: clip the global gradient norm of each step at this value (1.0: the reference
            code's HF Trainer default, paper 000's FedDPA code; None: off).
        lora: the adapters' LoRA config (r 8, alpha 16, dropout 0.05 on q_proj, v_proj by default;
            ``fedmosaic train --lora-r/--lora-alpha/--lora-dropout/--target-modules``).
        prompt_style: ``alpaca_short`` (paper) or ``chat``.
        compile: None (eager), or the ``torch.compile`` mode the runtime compiles the base model's decoder
            layers with (``default`` or ``max-autotune``;
            :func:`models.loaded.compile_decoder_layers`). The same training up to float summation order
            (bit-close in float32; in bf16 the fused kernels round less, nearer the float32 run), paid
            for by compiling once per process.
    """

    lr: float = 3e-4
    batch_size: int = 32
    micro_batch_size: int = 8
    local_epochs: float = 10
    max_steps: int | None = None
    cutoff_len: int = 512
    optimizer: str = "adamw"
    schedule: str = "linear"
    round_decay: float = 1.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lora: LoraConfig = field(default_factory=LoraConfig)
    prompt_style: str = "alpaca_short"
    compile: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "micro_batch_size", "cutoff_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.local_epochs > 0:
            raise ValueError(f"TrainConfig.local_epochs must be > 0, got {self.local_epochs}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"TrainConfig.max_grad_norm must be > 0 or None (off), got {self.max_grad_norm}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be >= 1 or None, got {self.max_steps}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer must be adamw, adam or sgd, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrainConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.compile is not None:
            check_compile_mode(self.compile, "TrainConfig.compile must be None or a compile mode")
        if not 0 < self.round_decay <= 1:
            raise ValueError(f"TrainConfig.round_decay must be in (0, 1], got {self.round_decay}")
        PromptConfig.named(self.prompt_style)  # a DataError (a ValueError) naming the style and the choices

    def round_lr(self, round_idx: int) -> float:
        """The learning rate round ``round_idx`` starts from (a final fine-tune, round -1, uses round 0's)."""
        return self.lr * self.round_decay ** max(0, round_idx)

    def asdict(self) -> dict[str, Any]:
        """JSON-ready settings."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "lora"}
        out["lora"] = self.lora.asdict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`asdict`."""
        data = dict(data)
        raw = data.pop("lora", None)
        lora = LoraConfig(**raw) if raw else LoraConfig()  # a names list becomes a tuple, a regex stays a string
        return cls(lora=lora, **data)


# FedDPA's regime under each budget (``--preset``); a method's own regime: training.settings.method_settings.
PRESETS: dict[str, TrainConfig] = {name: TrainConfig(**train_fields(FEDDPA_REGIME, name)) for name in BUDGETS}


def preset(name: str, regime: Regime | None = None, **overrides: Any) -> TrainConfig:
    """``regime`` (default FedDPA's) under budget ``name``, with field overrides (None values are ignored).

    Raises:
        ValueError: an unknown preset or an invalid override.
    """
    base = TrainConfig(**train_fields(regime or FEDDPA_REGIME, name))
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


class Runtime:
    """The frozen base model with two adapter slots, shared by every simulated client."""

    def __init__(self, loaded: LoadedModel, train: TrainConfig) -> None:
        self.loaded = loaded
        self.train = train
        self.adapted: AdaptedModel = inject(loaded.model, train.lora.target_modules)
        for i, name in enumerate(SLOTS):
            self.adapted.add_adapter(name, train.lora, seed=i)
        if train.compile is not None:
            compile_decoder_layers(loaded.model, train.compile)
        self._examples: dict[tuple[str, int], list[Example]] = {}

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def device(self) -> torch.device:
        """Where the model (and every tensor a training step creates) lives."""
        return self.loaded.device

    def get(self, name: str) -> StateDict:
        """A detached CPU copy of adapter ``name``'s tensors (what travels and is stored)."""
        return {k: v.to("cpu", copy=True) for k, v in self.adapted.adapter_state(name).items()}

    def set(self, name: str, state: StateDict) -> None:
        """Load tensors into adapter ``name``."""
        self.adapted.load_adapter_state(name, state)

    def fresh(self, name: str, seed: int) -> StateDict:
        """Re-initialise ``name`` with PEFT's init from ``seed`` (B = 0) and return its tensors.

        The draw is on the CPU (then copied to the model), so a seed means the same on every device.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for _, layer in self.adapted.adapter_layers(name):
            layer.adapters[name].reset(gen)
            layer.invalidate_cache()
        return self.get(name)

    def params(self, name: str) -> dict[str, torch.nn.Parameter]:
        """Adapter ``name``'s parameters by state key (``<path>.lora_A`` / ``.lora_B``)."""
        out: dict[str, torch.nn.Parameter] = {}
        for path, layer in self.adapted.adapter_layers(name):
            out[f"{path}.lora_A"] = layer.adapters[name].lora_A
            out[f"{path}.lora_B"] = layer.adapters[name].lora_B
        return out

    def examples(self, client: ClientData) -> list[Example]:
        """Tokenized training examples of a client (cached)."""
        key = (client.client_id, len(client.train))
        if key not in self._examples:
            prompt = PromptConfig.named(self.train.prompt_style)
            all_examples = [tokenize_record(r, self.tokenizer, self.train.cutoff_len, prompt) for r in client.train]
            # A prompt longer than the cutoff leaves no response token to learn from (and a NaN loss).
            usable = [e for e in all_examples if any(label != IGNORE for label in e.labels)]
            if not usable:
                raise ValueError(
                    f"client {client.client_id!r}: every example is cut before its response at "
                    f"cutoff_len={self.train.cutoff_len}; raise the cutoff"
                )
            if len(usable) < len(all_examples):
                warnings.warn(f"client {client.client_id!r}: {len(all_examples) - len(usable)} examples have no "
                              f"response tokens within cutoff_len={self.train.cutoff_len} and are skipped",
                              stacklevel=2)
            self._examples[key] = usable
        return self._examples[key]
