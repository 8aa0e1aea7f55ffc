"""The engine's limits and runner choices, one frozen dataclass checked on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and runner choices.

    Attributes:
        max_batch_size: sequences held at once (KV slots); later requests wait.
        max_model_len: prompt plus completion tokens at most per request.
        max_waiting: queued requests at most; beyond it :meth:`Engine.submit` raises EngineOverloaded.
        max_prefill_tokens: prompt tokens prefilled per step (chunked prefill): bounds how long a
            long prompt can hold up the running requests' next token. In a step with no running
            requests it bounds each forward: routed requests' exact passes get a budget of their own.
        max_decode_skips: steps in a row that may prefill without decoding while prompts wait for
            their first token, queued or starting their prefill in the step (0: every step decodes);
            new requests get their first tokens before the running rows their next one, and a long
            prompt's later chunks ride in the decode's forward.
        request_timeout_s: a request still unfinished this long after submission is answered with
            an error (504); None: no deadline.
        runner: ``auto`` (the fused Llama runner when the model allows it), ``fused`` or ``hf``.
        lora_slots: adapters one fused step can mix (default ``max_batch_size + 1``: a global
            adapter and one local adapter per row); steps needing more run on the HF forward.
        max_lora_rank: largest adapter rank the fused runner serves; its slots hold the largest rank
            served so far (fixed at this one under CUDA graphs), smaller ranks zero-padded.
        cuda_graphs: capture fused decode steps as CUDA graphs on CUDA.
        prefix_cache_slots: recent prompts whose KV is kept for later prompts sharing a prefix under
            the same adapter weights (:mod:`serving.engine.prefix_cache`; 0: off).
        route_state_cache: routing states remembered by prompt (:mod:`serving.engine.route_states`): a
            prompt routed again, for another client, skips its routing pass (0: off).
        auto_slots: replace ``max_batch_size`` by the slots the device's free memory holds
            (:mod:`serving.engine.sizing`; ``fedmosaic serve`` without ``--max-batch-size``).
        auto_context: replace ``max_model_len`` by the model's context (capped; shortened when too few
            slots would fit).
        count_syncs: count host-device synchronisations per step (:mod:`serving.engine.host_work`; costs a
            Python call per torch call, so for profiling only).
    """

    max_batch_size: int = 8
    max_model_len: int = 2048
    max_waiting: int = 256
    max_prefill_tokens: int = 512
    max_decode_skips: int = 2
    request_timeout_s: float | None = None
    runner: Literal["auto", "fused", "hf"] = "auto"
    lora_slots: int | None = None
    max_lora_rank: int = 16
    cuda_graphs: bool = True
    prefix_cache_slots: int = 4
    route_state_cache: int = 4096
    auto_slots: bool = False
    auto_context: bool = False
    count_syncs: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_model_len", "max_waiting", "max_prefill_tokens", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_decode_skips", "prefix_cache_slots", "route_state_cache"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.lora_slots is not None and self.lora_slots < 1:
            raise ValueError(f"EngineConfig.lora_slots must be >= 1, got {self.lora_slots}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"EngineConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.runner not in ("auto", "fused", "hf"):
            raise ValueError(f"EngineConfig.runner must be auto, fused or hf, got {self.runner!r}")
