"""The engine's limits and runner choices, defined once: one frozen dataclass checked on construction.

:class:`EngineConfig` is the one definition of each limit: its name, type, default, help text (the
``help`` metadata of its field) and lower bound (``ge``). The edges derive the rest from it, as they do
from FedDPA's options (``routing.feddpa_options``): the server's settings ``FEDMOSAIC_SERVE_<NAME>``
(``serving.settings.ServeSettings``: description and bound from here, the default too unless the server's
differs), ``fedmosaic serve``'s flags (``serving.cli``) and the stack's config
(``ServeSettings.engine_config``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


def _limit(default: Any, help: str, ge: int | None = None) -> Any:  # noqa: A002 - argparse's word
    return field(default=default, metadata={"help": help, "ge": ge})


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and runner choices; every field's ``help`` is its documentation.

    Raises (on construction):
        ValueError: a limit below its bound, a deadline that is not positive, or an unknown runner.
    """

    max_batch_size: int = _limit(8, "KV slots: requests decoded at once (later requests wait)", ge=1)
    max_model_len: int = _limit(2048, "prompt plus completion tokens per request at most", ge=1)
    max_waiting: int = _limit(256, "queued requests at most; beyond them a request is refused "
                              "(EngineOverloaded, answered 429)", ge=1)
    max_prefill_tokens: int = _limit(512, "prompt tokens prefilled per engine step, longer prompts in chunks: "
                                     "bounds how long a long prompt holds up the running requests' next token "
                                     "(in a step with none running it bounds each forward, and routed prompts' "
                                     "exact passes get a budget of their own)", ge=1)
    max_decode_skips: int = _limit(2, "steps in a row that prefill prompts waiting for their first token (queued "
                                   "or starting their prefill in the step) without decoding the running ones "
                                   "(0: every step decodes); a long prompt's later chunks ride in the decode's "
                                   "forward", ge=0)
    request_timeout_s: float | None = _limit(None, "seconds after submission before an unfinished request is "
                                             "answered with an error (504); none: no deadline")
    runner: Literal["auto", "fused", "hf"] = _limit("auto", "auto (the fused Llama runner when the model allows "
                                                    "it), fused or hf")
    lora_slots: int | None = _limit(None, "adapters one fused step can mix (none: max_batch_size + 1, a global "
                                    "adapter and one local adapter per row); steps needing more run on the HF "
                                    "forward", ge=1)
    max_lora_rank: int = _limit(16, "largest adapter rank the fused runner serves (vLLM's --max-lora-rank); its "
                                "slots hold the largest rank served so far (fixed at this one under CUDA graphs), "
                                "smaller ranks zero-padded, a larger adapter runs on the HF forward", ge=1)
    cuda_graphs: bool = _limit(True, "capture fused decode steps as CUDA graphs on CUDA")
    prefix_cache_slots: int = _limit(4, "recent prompts whose KV later prompts sharing a prefix under the same "
                                     "adapter weights reuse (serving.engine.prefix_cache; 0: off)", ge=0)
    route_state_cache: int = _limit(4096, "FedDPA routing states remembered by prompt, per tenant and adapter "
                                    "version (serving.engine.route_states): the same prompt for another client "
                                    "skips its routing pass (0: off)", ge=0)
    auto_slots: bool = _limit(False, "as many slots as the device's free memory holds, in place of max_batch_size "
                              "(serving.engine.sizing: CUDA 0.8 x free, at most 256; CPU 0.25 x available RAM, "
                              "at most 64)")
    auto_context: bool = _limit(False, "the model's context in place of max_model_len, at most 8192 (shorter when "
                                "fewer than 4 slots would fit)")
    count_syncs: bool = _limit(False, "count host-device synchronisations per engine step (serving.engine."
                               "host_work; /metrics fedmosaic_engine_syncs_total; a Python call per torch call: "
                               "for profiling only)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, least = getattr(self, f.name), f.metadata["ge"]
            if least is not None and value is not None and value < least:
                raise ValueError(f"EngineConfig.{f.name} must be >= {least}, got {value}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"EngineConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.runner not in ("auto", "fused", "hf"):
            raise ValueError(f"EngineConfig.runner must be auto, fused or hf, got {self.runner!r}")


def limit_help(name: str) -> str:
    """The help text of engine limit ``name``."""
    return str(EngineConfig.__dataclass_fields__[name].metadata["help"])


def limit_default(name: str) -> Any:
    """The default of engine limit ``name``."""
    return EngineConfig.__dataclass_fields__[name].default


def limit_bound(name: str) -> int | None:
    """The least value engine limit ``name`` takes (None: no lower bound of that kind)."""
    bound = EngineConfig.__dataclass_fields__[name].metadata["ge"]
    return int(bound) if bound is not None else None
