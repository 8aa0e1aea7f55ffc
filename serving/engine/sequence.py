"""One request inside the engine: its phase, KV slot, tokens, text and result.

A sequence moves through phases: ``waiting`` (queued, no slot), then prefill, chunk by chunk —
``route`` (a FedDPA request's prompt with its prefill weights, paper 000 section 4.3, to get the
final-layer state its ``weight_fn`` turns into weights) and/or ``fill`` (the prompt with the
weights it decodes with) — then ``decode`` until a stop, the length limit, a cancel, a deadline or an
error ends it. Errors carry the HTTP-neutral status the API reports: 400 when the request caused
the failure, 500 (with the request id) otherwise, 504 past the server's deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from adapters import AdapterError
from routing.base import StoredRoutingError
from serving.engine.amole import AMoLEClientRoute, usage_report
from serving.engine.grammar import GrammarMatcher
from serving.engine.request import FinishReason, GenerationResult, RequestHandle
from serving.engine.runner.inputs import RowAdapters
from serving.engine.sampling import TokenLogprob
from serving.engine.text import TextTracker
from serving.errors import InvalidRequest

Phase = Literal["waiting", "route", "fill", "decode"]
Finished = list[tuple[RequestHandle, GenerationResult]]  # results a step hands out once it lets the model go


@dataclass(eq=False)
class SeqState:
    """Engine-internal state of one request (mutated by the engine thread only)."""

    handle: RequestHandle
    ids: list[int]
    tracker: TextTracker
    generator: torch.Generator | None
    deadline: float | None = None
    slot: int | None = None
    phase: Phase = "waiting"
    filled: int = 0  # prompt positions written in the current phase
    begun: int = 0  # where the current phase's pass began (after a reused prefix): filled == begun, not started
    adapters: RowAdapters = RowAdapters()  # what the current phase runs with
    weights: tuple[float, ...] = ()  # the decode weights (after routing)
    info: dict[str, Any] = field(default_factory=dict)
    output: list[int] = field(default_factory=list)
    next_token: int = -1
    amole: AMoLEClientRoute | None = None
    usage: torch.Tensor | None = None  # (bundle layers, num_experts) top-k selections so far
    layer_idx: torch.Tensor | None = None  # the bundle's layers among the engine's layer paths
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    state_sum: torch.Tensor | None = None  # (H,) final-layer states summed over the routed prompt so far
    submitted: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None  # seconds from submission to the first generated token
    public: int = 0  # leading prompt tokens of server template text (other tenants' cached KV may serve them)
    matcher: GrammarMatcher | None = None  # the row's place in its request's grammar (serving.engine.grammar)

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    @property
    def position(self) -> int:
        """Position of :attr:`next_token` (decode phase)."""
        return len(self.ids) + len(self.output) - 1

    @property
    def kv_slot(self) -> int:
        """The KV slot of a sequence being prefilled or decoded (the engine gives it one before either)."""
        assert self.slot is not None, f"request {self.request_id} runs without a KV slot"
        return self.slot

    @property
    def held(self) -> int:
        """Positions this sequence's slot holds."""
        return self.filled if self.phase in ("route", "fill") else len(self.ids) + max(len(self.output) - 1, 0)


def error_status(exc: BaseException) -> int:
    """400 when the request itself caused ``exc``, else 500 (a client's broken routing files are the server's)."""
    if isinstance(exc, StoredRoutingError):
        return 500
    return 400 if isinstance(exc, InvalidRequest | AdapterError | ValueError) else 500


def error_message(seq: SeqState | RequestHandle, exc: BaseException, status: int) -> str:
    """What the caller is told: the cause for a 400; a generic message and the request id for a 500."""
    if status == 400:
        return str(exc)
    return (f"internal error while serving request {seq.request_id} ({type(exc).__name__}); "
            "the server logged the details under this id")


def result(seq: SeqState, reason: FinishReason, error: str | None = None, status: int | None = None
           ) -> GenerationResult:
    """The finished result of ``seq`` (text up to what was emitted when cancelled or failed)."""
    req = seq.handle.request
    if seq.amole is not None and seq.usage is not None:
        seq.info["expert_usage"] = usage_report(seq.amole, seq.usage, len(seq.output))
    partial = reason in ("cancelled", "error")
    text = seq.tracker.text[: seq.tracker.emitted] if partial else seq.tracker.text
    return GenerationResult(
        request_id=req.request_id, text=text, token_ids=tuple(seq.output), finish_reason=reason,
        prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output), adapter_names=req.adapter_names,
        adapter_weights=seq.weights or tuple(req.adapter_weights), route_info=seq.info, error=error,
        error_status=status, first_token_s=seq.first_token_s,
        logprobs=tuple(seq.logprobs) if req.sampling.logprobs is not None else None,
        prompt_logprobs=tuple(seq.prompt_logprobs) if req.sampling.prompt_logprobs is not None else None)


def failed(seq: SeqState, exc: BaseException) -> GenerationResult:
    """The error result of ``seq`` for ``exc`` (status from :func:`error_status`)."""
    status = error_status(exc)
    return result(seq, "error", error_message(seq, exc, status), status)
