"""Shared by the chat and completion routes: request -> engine submission -> JSON or SSE response.

The route modules only build the prompt and the response shapes; leasing adapter versions, sampling
parameters, SSE framing, cancellation on disconnect and metrics are here, once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from serving.api import builders
from serving.api.dependencies import ServerState
from serving.api.errors import error_payload
from serving.api.protocol import SamplingFields
from serving.request import GenerationResult, RequestHandle
from serving.sampling import SamplingParams
from serving.stack import Job
from serving.targets import TargetPlan


@dataclass(frozen=True)
class Started:
    """A submitted request and what the response needs to say about it."""

    handle: RequestHandle
    plan: TargetPlan
    response_id: str
    created: int
    t0: float


def sampling_params(body: SamplingFields, state: ServerState) -> SamplingParams:
    """Validate the server's token limits and build the engine's sampling parameters."""
    return builders.sampling_params(body, state.settings.max_tokens_limit, state.settings.default_max_tokens)


async def start(state: ServerState, body: SamplingFields, prompt: str, params: SamplingParams, prefix: str) -> Started:
    """Resolve the target, lease its adapter versions and submit the request (:meth:`ServingStack.submit`)."""
    assert state.stack is not None
    job = Job(target=body.model, sampling=params, prompt=prompt,
              mixture=tuple(body.mixture()) if body.mixture() else None)
    # leasing may reload an evicted adapter from disk: off the event loop
    submitted = await run_in_threadpool(state.stack.submit, job)
    return Started(submitted.handle, submitted.plan, f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                   time.perf_counter())


def usage(result: GenerationResult) -> dict[str, int]:
    """The OpenAI usage object."""
    return builders.usage(result)


def extension(started: Started, result: GenerationResult | None) -> dict[str, Any]:
    """The ``fedmosaic`` response field: mode, weights used per adapter, routing info."""
    return builders.extension(started.plan, result)


def finish_reason(result: GenerationResult) -> str:
    """The OpenAI finish reason (an engine error or shutdown surfaces as an exception)."""
    return builders.finish_reason(result)


def record(state: ServerState, started: Started, result: GenerationResult, endpoint: str) -> None:
    """Update the metrics for a finished request."""
    m = state.metrics
    m.requests.labels(endpoint, result.finish_reason).inc()
    m.prompt_tokens.inc(result.prompt_tokens)
    m.generation_tokens.inc(result.completion_tokens)
    m.latency.labels(endpoint).observe(time.perf_counter() - started.t0)
    if started.plan.mode == "feddpa" and len(result.adapter_weights) == 2:
        m.feddpa_weight.observe(result.adapter_weights[1])


async def complete(state: ServerState, started: Started, endpoint: str) -> GenerationResult:
    """Wait for the result (cancelling the request if the client goes away) and record it."""
    try:
        result = await started.handle.aresult()
    finally:
        if not started.handle.done:
            started.handle.cancel()
    record(state, started, result, endpoint)
    return result


def sse(state: ServerState, started: Started, endpoint: str,
        chunk: Callable[[str | None, str | None], dict[str, Any]], include_usage: bool) -> StreamingResponse:
    """Stream ``data: {chunk}`` events, then ``data: [DONE]``; a disconnect cancels the request.

    ``chunk(delta_text, finish_reason)`` builds one chunk object in the endpoint's shape.
    """

    async def events() -> AsyncIterator[str]:
        handle = started.handle
        try:
            first = chunk("", None)
            yield f"data: {json.dumps(first)}\n\n"
            async for delta in handle.astream():
                yield f"data: {json.dumps(chunk(delta, None))}\n\n"
            result = await handle.aresult()
            last = chunk(None, finish_reason(result))
            last["fedmosaic"] = extension(started, result)
            yield f"data: {json.dumps(last)}\n\n"
            if include_usage:
                tail = chunk(None, None)
                tail["choices"], tail["usage"] = [], usage(result)
                yield f"data: {json.dumps(tail)}\n\n"
            record(state, started, result, endpoint)
        except Exception as exc:  # headers are sent; report in-band as OpenAI does
            yield f"data: {json.dumps(error_payload(exc)[1])}\n\n"
        finally:
            if not handle.done:
                handle.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
