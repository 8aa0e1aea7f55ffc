"""What a generation request is, its result, and the handle a caller streams or waits on.

A :class:`GenerationRequest` names its adapters (the engine-internal, versioned names an
:class:`~serving.pool.pool.AdapterPool` lease gives out) and their weights ``(K,)``: one row of the
per-row weight matrix of the one contract (ARCHITECTURE.md). FedDPA instance weighting (paper 000 section 4.3)
plugs in through ``weight_fn``: the engine hands it the prompt's final-layer last-token state, taken
during prefill, and decodes with the weights it returns.

:class:`RequestHandle` is written by the engine thread and read by any thread or asyncio task: text
deltas are appended under a condition variable, and asyncio waiters are woken with
``call_soon_threadsafe`` so an event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from serving.engine.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from serving.engine.amole import AMoLEClientRoute

FinishReason = Literal["stop", "length", "cancelled", "error"]

# ((H,) float32 final-layer state of the prompt's last token (or the mean over its tokens, ``state_pooling``),
#  the prompt's token ids) -> (adapter weights (K,), info for the response)
WeightFn = Callable[[torch.Tensor, Sequence[int]], tuple[Sequence[float], Mapping[str, Any]]]


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to generate.

    Attributes:
        prompt: already-templated prompt text (tokenized without special tokens); or give ``prompt_ids``.
        prompt_ids: prompt token ids; wins over ``prompt``.
        sampling: decoding parameters.
        adapter_names: K adapter names loaded in the model (empty: the base model).
        adapter_weights: (K,) weights over ``adapter_names`` for every forward of this request.
        request_id: a unique id (a random one by default).
        weight_fn: routing hook; when set, prefill runs with ``prefill_weights`` and hands the
            prompt's final-layer last-token state and its token ids to ``weight_fn``, whose weights
            are used from the first decode step on (FedDPA: ``prefill_weights`` puts the global
            adapter alone at 1). The state may come from a prefix reused from another prompt's pass
            (float rounding apart the same state): anything random must key on the ids, not the state.
        prefill_weights: (K,) weights of the prefill when ``weight_fn`` is set.
        exact_prefill: with ``weight_fn``, run the prefill a second time with the routed weights so
            the prompt's KV cache and the first token use them too (2x prefill cost, exact FedDPA).
        route: an AMoLE client's route (what a pool lease hands out, paper 002 section 4.2): every
            token is routed over that client's experts; no plain adapters and no ``weight_fn`` then.
        state_pooling: the state ``weight_fn`` gets: the last prompt token's (``last``) or the mean of
            the final-layer states over the prompt's tokens (``mean``, paper 000 Table 10).
        cache_scope: the prefix-cache partition (the caller's tenant): the prompt reuses all it shares
            with prompts of the same scope, of others' only ``shared_prefix`` (:mod:`serving.engine.prefix_cache`).
        shared_prefix: the leading text of ``prompt`` that is the server's chat template, before the first
            message's content (the same for every tenant); "" for raw prompts.
    """

    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    adapter_names: tuple[str, ...] = ()
    adapter_weights: tuple[float, ...] = ()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    weight_fn: WeightFn | None = field(default=None, compare=False)
    prefill_weights: tuple[float, ...] | None = None
    exact_prefill: bool = False
    route: AMoLEClientRoute | None = field(default=None, compare=False)
    state_pooling: Literal["last", "mean"] = "last"
    cache_scope: str = field(default="", repr=False)
    shared_prefix: str = ""

    def __post_init__(self) -> None:
        if self.state_pooling not in ("last", "mean"):
            raise ValueError(f"state_pooling must be 'last' or 'mean', got {self.state_pooling!r}")
        if self.prompt is None and self.prompt_ids is None:
            raise ValueError("a request needs prompt or prompt_ids")
        if self.prompt_ids is not None and len(self.prompt_ids) == 0:
            raise ValueError("prompt_ids must not be empty")
        if len(self.adapter_weights) != len(self.adapter_names):
            raise ValueError(
                f"{len(self.adapter_weights)} adapter weights for {len(self.adapter_names)} adapters "
                f"{self.adapter_names}"
            )
        if len(set(self.adapter_names)) != len(self.adapter_names):
            raise ValueError(f"adapter names must be unique, got {self.adapter_names}")
        if self.prefill_weights is not None and len(self.prefill_weights) != len(self.adapter_names):
            raise ValueError("prefill_weights must have one weight per adapter name")
        if self.route is not None and (self.adapter_names or self.weight_fn is not None):
            raise ValueError("an AMoLE route routes every token itself: no adapter names or weight_fn beside it")


@dataclass(frozen=True)
class GenerationResult:
    """A finished request.

    Attributes:
        request_id: the request's id.
        text: the completion (stop string trimmed, special tokens skipped).
        token_ids: generated token ids (the stop-string match included: it was generated).
        finish_reason: ``stop`` (eos or a stop string), ``length``, ``cancelled`` or ``error``.
        prompt_tokens: prompt length in tokens.
        completion_tokens: generated tokens.
        adapter_names: the adapters of the decode.
        adapter_weights: the weights the decode used (after routing).
        route_info: what ``weight_fn`` reported (empty without routing).
        error: the message when ``finish_reason`` is ``error``.
        error_status: with an error, the HTTP-neutral status: 400 the request caused it, 500 the
            server failed (the message names the request id), 504 the server's deadline passed.
        logprobs: per generated token, its log-probability and top alternatives (when asked for).
        prompt_logprobs: per prompt token likewise, None for the first (nothing predicts it).
        first_token_s: seconds from submission to the first generated token (queue, prefill and
            routing included); None when no token was generated.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    adapter_names: tuple[str, ...] = ()
    adapter_weights: tuple[float, ...] = ()
    route_info: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    error_status: int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    first_token_s: float | None = None


class RequestHandle:
    """The caller's side of a submitted request: stream text deltas, wait, or cancel."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._cond = threading.Condition()
        self._chunks: list[str] = []
        self._result: GenerationResult | None = None
        self._cancelled = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._callbacks: list[Callable[[GenerationResult], None]] = []

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        """True once the result is set."""
        return self._result is not None

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Ask the engine to drop this request; its row leaves the batch at the next step."""
        self._cancelled = True

    def add_done_callback(self, fn: Callable[[GenerationResult], None]) -> None:
        """Call ``fn(result)`` once the request finishes (at once when it already has)."""
        with self._cond:
            if self._result is None:
                self._callbacks.append(fn)
                return
            result = self._result
        fn(result)

    # --- engine side ---------------------------------------------------------------------------

    def push(self, delta: str) -> None:
        """Append a text delta (engine thread)."""
        if delta:
            with self._cond:
                self._chunks.append(delta)
                self._wake()

    def finish(self, result: GenerationResult) -> None:
        """Set the result and wake every reader (engine thread)."""
        with self._cond:
            if self._result is not None:
                return
            self._result = result
            callbacks, self._callbacks = self._callbacks, []
            self._wake()
        for fn in callbacks:
            fn(result)

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, event in self._waiters:
            loop.call_soon_threadsafe(event.set)
        self._waiters.clear()

    # --- reader side ---------------------------------------------------------------------------

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request finishes and return its result.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            assert self._result is not None
            return self._result

    def _has_news(self, seen: int) -> bool:
        """Whether more than ``seen`` deltas or the result are there (called holding the condition's lock)."""
        return len(self._chunks) > seen or self._result is not None

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yield text deltas as they are produced (their concatenation is the final text)."""
        seen = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(functools.partial(self._has_news, seen), timeout):
                    raise TimeoutError(f"request {self.request_id} produced nothing within {timeout} s")
                new, finished = self._chunks[seen:], self._result is not None
            seen += len(new)
            yield from new
            if finished and not new:
                return

    async def astream(self) -> AsyncIterator[str]:
        """Asynchronous :meth:`stream` for an event loop (never blocks the loop)."""
        seen = 0
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                new, finished = self._chunks[seen:], self._result is not None
                event: asyncio.Event | None = None
                if not new and not finished:
                    event = asyncio.Event()
                    self._waiters.append((loop, event))
            if event is not None:
                await event.wait()
                continue
            seen += len(new)
            for chunk in new:
                yield chunk
            if finished and not new:
                return

    async def aresult(self) -> GenerationResult:
        """Asynchronous :meth:`result`."""
        async for _ in self.astream():
            pass
        assert self._result is not None
        return self._result
