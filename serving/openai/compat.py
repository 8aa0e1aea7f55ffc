"""vLLM's request conventions beyond OpenAI's: unknown fields, the model's sampling defaults, ``best_of``.

* **Unknown fields.** A chat or completion body (and each chat message) may carry fields this server
  does not model: they are ignored, with one warning per field name for the server's lifetime, as
  vLLM does; ``--strict-fields`` refuses them instead (400 naming the field).
* **Sampling defaults.** A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty`` or ``max_tokens`` unset (or null) takes the value of the model's
  ``generation_config.json`` (``max_new_tokens`` for ``max_tokens``), else vLLM's default; only the
  values that differ from transformers' defaults count (vLLM's ``get_diff_sampling_param``).
  ``--generation-config vllm`` ignores the model's file, a folder reads that folder's file instead.
* **best_of.** A completion with ``best_of`` > ``n`` samples ``best_of`` candidates per prompt and
  answers the ``n`` with the highest cumulative log-probability (the sum over the generated tokens'
  log-probabilities under the model, vLLM's rule), best first.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from serving.engine.sampling import SamplingParams
from serving.errors import InvalidRequest
from serving.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def unknown_fields(body: BaseModel) -> list[str]:
    """The fields of ``body`` no schema declares: top-level names, and ``messages.<name>`` for a message's."""
    names = list(body.model_extra or {})
    if isinstance(body, ChatCompletionRequest):
        names += [f"messages.{k}" for m in body.messages for k in (m.model_extra or {}) if f"messages.{k}" not in names]
    return names


class FieldPolicy:
    """What happens to unknown request fields: one warning per name (default), or a 400 (``strict``).

    Thread-safe: the routes call it from the event loop and the batch runner from its own thread.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: BaseModel) -> list[str]:
        """Apply the policy to ``body``; return the names that were ignored.

        Raises:
            InvalidRequest: ``strict`` and ``body`` has an unknown field (named in ``param``).
        """
        names = unknown_fields(body)
        if names and self.strict:
            raise InvalidRequest(f"{names[0]}: unknown field: not an OpenAI or vLLM parameter this server implements "
                                 "(the server runs with --strict-fields; docs/serving.md lists the parameters)",
                                 param=names[0])
        with self._lock:
            new = [n for n in names if n not in self._warned]
            self._warned.update(new)
        for name in new:
            logger.warning("ignoring the unknown request field %r (warned once per field name; --strict-fields "
                           "refuses such requests)", name)
        return names


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's sampling defaults (None: vLLM's own default stands)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> SamplingDefaults:
        """The defaults among a generation config's ``values`` (``max_new_tokens`` is ``max_tokens``).

        Raises:
            ValueError: a value of the wrong type or out of its range, naming ``source`` and the key.
        """
        picked: dict[str, Any] = {}
        for f in fields(cls):
            key = "max_new_tokens" if f.name == "max_tokens" else f.name
            value = values.get(key)
            if value is None:
                continue
            integer = f.name in ("top_k", "max_tokens")
            ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
            if isinstance(value, bool) or not ok or (value < 0 and f.name != "top_k"):
                raise ValueError(f"{source}: {key} = {value!r} is not a valid default")
            picked[f.name] = value
        try:  # the engine's own checks, at start-up rather than on every request
            SamplingParams(**{k: v for k, v in picked.items() if k not in ("top_k", "max_tokens")},
                           top_k=max(picked.get("top_k", 0), 0), max_tokens=picked.get("max_tokens") or 1)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc
        return cls(**picked)

    def pick(self, body: SamplingFields, name: str, fallback: float) -> float:
        """``body``'s ``name`` when the request set it (not null), else this default, else ``fallback``."""
        value = getattr(body, name)
        if name in body.model_fields_set and value is not None:
            return float(value)
        default = getattr(self, name)
        return fallback if default is None else float(default)


def generation_defaults(source: str, generation_config: Any = None) -> SamplingDefaults:
    """The sampling defaults ``--generation-config`` selects.

    Args:
        source: ``auto`` (the loaded model's generation config), ``vllm`` (none: vLLM's defaults), or a
            folder holding a ``generation_config.json``.
        generation_config: the loaded model's ``transformers.GenerationConfig`` (for ``auto``; None: none).

    Raises:
        ValueError: the folder's file is missing or malformed, or a value is invalid (named).
    """
    if source == "vllm":
        return SamplingDefaults()
    if source == "auto":
        if generation_config is None:
            return SamplingDefaults()
        # only what differs from transformers' defaults, as vLLM reads it
        return SamplingDefaults.from_mapping(generation_config.to_diff_dict(), "the model's generation config")
    path = Path(source) / GENERATION_CONFIG
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {source}: cannot read {path}: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"--generation-config {source}: {path} is not a JSON object")
    return SamplingDefaults.from_mapping(values, str(path))


def candidates(body: SamplingFields) -> int:
    """Engine requests per prompt: ``best_of`` for a completion that sets it, else ``n``."""
    n = body.n or 1
    if isinstance(body, CompletionRequest) and body.best_of is not None:
        return max(body.best_of, n)
    return n


def picks_best(body: SamplingFields) -> bool:
    """True when the response keeps only the best ``n`` of more candidates."""
    return candidates(body) > (body.n or 1)
