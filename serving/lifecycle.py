"""The engine's settings and a request's life: validation, prefill phases, routing, each new token.

:class:`Lifecycle` is the engine's half that needs no scheduling: it turns a
:class:`~serving.request.GenerationRequest` into a validated :class:`~serving.sequence.Sequence`,
chooses the prefill phases (a FedDPA request first prefills with its prefill weights and hands its
final-layer state to ``weight_fn``, paper 000 section 4.3), and records every sampled token (stop
strings, end of sequence, length limits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from serving.errors import AdapterNotFound, InvalidRequest
from serving.logits import token_logprobs
from serving.request import FinishReason, GenerationRequest, RequestHandle
from serving.sampling import TextTracker, make_generator
from serving.sequence import Sequence

if TYPE_CHECKING:
    from serving.executor import RowOut
    from serving.prefix_cache import PrefixCache
    from serving.runner.inputs import PrefillRow, RowAdapters


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
            the same adapter weights (:mod:`serving.prefix_cache`; 0: off).
        auto_slots: replace ``max_batch_size`` by the slots the device's free memory holds
            (:mod:`serving.sizing`; ``fedmosaic serve`` without ``--max-batch-size``).
        auto_context: replace ``max_model_len`` by the model's context (capped; shortened when too few
            slots would fit).
        count_syncs: count host-device synchronisations per step (:mod:`serving.host_work`; costs a
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
    auto_slots: bool = False
    auto_context: bool = False
    count_syncs: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_model_len", "max_waiting", "max_prefill_tokens", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_decode_skips", "prefix_cache_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.lora_slots is not None and self.lora_slots < 1:
            raise ValueError(f"EngineConfig.lora_slots must be >= 1, got {self.lora_slots}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"EngineConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.runner not in ("auto", "fused", "hf"):
            raise ValueError(f"EngineConfig.runner must be auto, fused or hf, got {self.runner!r}")


class Lifecycle:
    """Request validation and phase changes (mixed into :class:`serving.engine.Engine`)."""

    config: EngineConfig
    tokenizer: object
    adapted: object
    vocab_size: int
    eos_ids: frozenset[int]
    device: torch.device
    prefixes: PrefixCache

    def row_adapters(self, seq: Sequence, weights: tuple[float, ...]) -> RowAdapters: ...

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        except (UnicodeError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"the prompt is not valid text ({type(exc).__name__}: {exc}); send UTF-8 "
                                 "text without lone surrogates", param="prompt") from exc

    def prepare(self, request: GenerationRequest) -> Sequence:
        """Validate ``request`` and make its waiting sequence (raises the errors of ``submit``)."""
        ids = list(request.prompt_ids) if request.prompt_ids is not None else self._encode(request.prompt or "")
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization", param="prompt")
        if any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        vocab_ids = [t for t, _ in request.sampling.logit_bias] + list(request.sampling.stop_token_ids)
        if any(t >= self.vocab_size for t in vocab_ids):
            raise InvalidRequest(f"logit_bias and stop_token_ids take token ids below the vocabulary size "
                                 f"{self.vocab_size}", param="logit_bias")
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; this server allows {self.config.max_model_len} "
                "tokens of prompt plus completion", param="prompt")
        loaded = set(getattr(self.adapted, "configs", {}) or {})
        missing = [n for n in request.adapter_names if n not in loaded]
        if missing:
            raise AdapterNotFound(f"adapters {missing} are not loaded in the model")
        route = request.route
        if route is not None and any(n not in loaded for n in route.bundle.adapter_names):
            raise AdapterNotFound(f"the AMoLE version {route.bundle.internal!r} is no longer loaded")
        params = request.sampling
        try:
            generator = make_generator(params, self.device)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"seed {params.seed!r} cannot seed a generator: {exc}", param="seed") from exc
        timeout = self.config.request_timeout_s
        seq = Sequence(handle=RequestHandle(request), ids=ids, tracker=TextTracker(self.tokenizer, params.stop),
                       generator=generator, deadline=time.monotonic() + timeout if timeout else None,
                       weights=tuple(request.adapter_weights), amole=route)
        if route is not None:
            seq.info = route.info()
        if request.shared_prefix and request.prompt_ids is None and (request.prompt or "").startswith(
                request.shared_prefix):
            shared = self._encode(request.shared_prefix)
            seq.public = next((i for i, (a, b) in enumerate(zip(shared, ids, strict=False)) if a != b),
                              min(len(shared), len(ids)))
        return seq

    def begin_prefill(self, seq: Sequence) -> None:
        """Enter the first prefill phase (``route`` for a routed request, else ``fill``)."""
        req = seq.handle.request
        seq.filled, seq.state_sum = 0, None
        if seq.amole is not None:
            index = {p: i for i, p in enumerate(getattr(self.adapted, "layers", {}))}
            seq.layer_idx = torch.tensor([index[p] for p in seq.amole.bundle.layers])
            seq.phase, seq.adapters = "fill", self.row_adapters(seq, (1.0,))
        elif req.weight_fn is not None:
            first = tuple(req.prefill_weights if req.prefill_weights is not None else req.adapter_weights)
            seq.phase, seq.adapters = "route", self.row_adapters(seq, first)
        else:
            seq.phase, seq.adapters = "fill", self.row_adapters(seq, tuple(req.adapter_weights))
        self._reuse_prefix(seq)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start a prompt pass after the longest cached prefix of the prompt under the pass's weights.

        A routing pass reuses one too (FedDPA's is the global adapter alone, shared by every client's
        requests): its last token's state then differs from a full pass's by float rounding only, and
        the seeded random FedDPA draw keys on the prompt's ids, not on the state. Not a routing pass
        pooling the mean state (the reused positions' states are not computed), and not when the
        prompt's log-probabilities are asked for (every position's logits are needed).
        """
        req = seq.handle.request
        pooled = seq.phase == "route" and req.state_pooling != "last"
        if seq.slot is not None and req.sampling.prompt_logprobs is None and not pooled:
            seq.filled = self.prefixes.reuse(seq.adapters, seq.ids, seq.slot, req.cache_scope, seq.public)
        seq.begun = seq.filled

    def prefilled(self, seq: Sequence, out: RowOut) -> bool:
        """A chunk of the prompt went through; True when its first token is sampled from ``out``.

        A routing pass adds up the chunks' final-layer states; once the whole prompt went through,
        ``weight_fn`` gets the last token's state or their mean (``state_pooling``).

        Raises:
            Whatever ``weight_fn`` raises, and InvalidRequest when it returns the wrong number of
            weights; the engine fails the sequence with it.
        """
        req = seq.handle.request
        if seq.phase == "route" and req.state_pooling == "mean":
            assert out.state_sum is not None
            seq.state_sum = out.state_sum if seq.state_sum is None else seq.state_sum + out.state_sum
        if seq.filled < len(seq.ids):
            return False
        if seq.slot is not None:  # a routed request's fill pass is its exact pass, at weights routed for its prompt
            own = req.weight_fn is not None and seq.phase == "fill"
            self.prefixes.remember(seq.adapters, seq.ids, seq.slot, own=own, scope=req.cache_scope, public=seq.public)
        if seq.phase == "route":
            assert req.weight_fn is not None and out.state is not None
            state = out.state if req.state_pooling == "last" else seq.state_sum / len(seq.ids)  # type: ignore[operator]
            routed, info = req.weight_fn(state.cpu(), seq.ids)
            weights = tuple(float(w) for w in routed)
            if len(weights) != len(req.adapter_names):
                raise InvalidRequest(f"weight_fn returned {len(weights)} weights for {req.adapter_names}")
            seq.weights, seq.info = weights, dict(info)
            first = tuple(req.prefill_weights if req.prefill_weights is not None else req.adapter_weights)
            # Routed to the prefill's own weights (calibrated FedDPA's a = 0 for an unrelated prompt): this
            # pass already is the exact one, unless the prompt's log-probabilities were asked for.
            again = weights != tuple(float(w) for w in first) or req.sampling.prompt_logprobs is not None
            if req.exact_prefill and again:
                seq.phase, seq.filled, seq.adapters = "fill", 0, self.row_adapters(seq, weights)
                self._reuse_prefix(seq)
                return False
            seq.adapters = self.row_adapters(seq, weights)
        seq.phase = "decode"
        return True

    def record_prompt_logprobs(self, seq: Sequence, row: PrefillRow, logits: torch.Tensor) -> None:
        """Prompt tokens' log-probabilities from a chunk's (n, V) logits: position p predicts token p + 1."""
        if row.start == 0:
            seq.prompt_logprobs = [None]  # nothing predicts the first token (a re-prefill starts over)
        k = int(seq.handle.request.sampling.prompt_logprobs or 0)
        nxt = [seq.ids[p + 1] for p in range(row.start, row.end) if p + 1 < len(seq.ids)]  # the last: a completion's
        seq.prompt_logprobs += token_logprobs(logits[: len(nxt)], nxt, [k] * len(nxt))

    def advance(self, seq: Sequence, token: int) -> FinishReason | None:
        """Record one generated token, stream its text, and say whether the sequence is finished."""
        params = seq.handle.request.sampling
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic() - seq.submitted
        seq.output.append(token)
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.handle.push(seq.tracker.flush())
            return "stop"
        delta, stopped = seq.tracker.push(token)
        seq.handle.push(delta)
        if stopped:
            return "stop"
        if len(seq.output) >= params.max_tokens or seq.prompt_len + len(seq.output) >= self.config.max_model_len:
            seq.handle.push(seq.tracker.flush())
            return "length"
        seq.next_token = token
        return None
