"""Shared by the chat and completion routes: request -> engine submissions -> JSON or SSE response.

The route modules only pick the response shape (:mod:`serving.openai.responses`); the caller's access
to the target, leasing adapter versions, submitting every choice, SSE framing, cancellation on
disconnect and metrics are here, once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from serving.access import Principal
from serving.api.dependencies import ServerState
from serving.engine.request import GenerationResult
from serving.errors import InvalidRequest, ModelNotFound
from serving.openai.builders import Choice, Limits
from serving.openai.errors import error_payload
from serving.openai.responses import Answer, usage
from serving.openai.schemas import ChatCompletionRequest, SamplingFields
from serving.stack import Job, ServingStack, Submitted


class Shape(Protocol):
    """A response shape (:class:`~serving.openai.responses.ChatShape` or ``CompletionShape``)."""

    endpoint: str

    def body(self, answers: Sequence[Answer]) -> dict[str, Any]: ...
    def start(self, choice: Choice) -> dict[str, Any]: ...
    def delta(self, choice: Choice, text: str) -> dict[str, Any] | None: ...
    def end(self, answer: Answer) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Started:
    """The submitted choices of one request."""

    choices: tuple[Choice, ...]
    submitted: tuple[Submitted, ...]
    response_id: str
    created: int
    t0: float

    def cancel(self) -> None:
        """Cancel every choice still running."""
        for sub in self.submitted:
            if not sub.handle.done:
                sub.handle.cancel()


def limits(state: ServerState) -> Limits:
    """The server's request limits."""
    s = state.settings
    return Limits(s.max_tokens_limit, s.default_max_tokens, s.max_choices, state.sampling_defaults)


def check_access(state: ServerState, caller: Principal, body: SamplingFields) -> None:
    """Apply the unknown-field policy (:class:`~serving.openai.compat.FieldPolicy`), then refuse targets the
    caller's key is not bound to, as if they did not exist (404).

    Raises:
        InvalidRequest: an unknown field under ``--strict-fields``.
        ModelNotFound: ``model`` or an adapter of the mixture is outside the key's binding.
    """
    state.fields.check(body)
    if not caller.allows(body.model, state.base_name):
        raise ModelNotFound(f"the model {body.model!r} does not exist")
    for name, _ in body.mixture() or ():
        if not caller.allows(name, state.base_name):
            raise ModelNotFound(f"adapters [{name!r}] are not loaded")


def submit_all(stack: ServingStack, jobs: Sequence[Job]) -> list[Submitted]:
    """Submit every job; when one is refused, cancel those already submitted and re-raise."""
    done: list[Submitted] = []
    try:
        for job in jobs:
            done.append(stack.submit(job))
    except BaseException:
        for sub in done:
            sub.handle.cancel()
        raise
    return done


async def start(state: ServerState, body: SamplingFields, choices: Sequence[Choice], prefix: str,
                caller: Principal) -> Started:
    """Resolve the target, lease its adapter versions and submit every choice (access checked before).

    The choices run in ``caller``'s tenant: their prompts reuse only prefixes of that tenant's prompts.
    """
    assert state.stack is not None
    mixture = tuple(body.mixture() or ()) or None
    exact = state.settings.feddpa_prefill == "exact"
    jobs = [Job(target=body.model, sampling=c.sampling, prompt=c.prompt, prompt_ids=c.prompt_ids, mixture=mixture,
                exact_prefill=exact, cache_scope=caller.tenant, shared_prefix=c.shared_prefix) for c in choices]
    # leasing may reload an evicted adapter from disk: off the event loop
    try:
        submitted = await run_in_threadpool(submit_all, state.stack, jobs)
    except InvalidRequest as exc:
        if exc.param == "prompt" and isinstance(body, ChatCompletionRequest):
            exc.param = "messages"  # the engine's prompt is the chat's templated messages
        raise
    return Started(tuple(choices), tuple(submitted), f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                   time.perf_counter())


def record(state: ServerState, started: Started, answer: Answer, endpoint: str) -> None:
    """Update the metrics for a finished choice."""
    m, result = state.metrics, answer.result
    m.requests.labels(endpoint, result.finish_reason).inc()
    m.prompt_tokens.inc(result.prompt_tokens)
    m.generation_tokens.inc(result.completion_tokens)
    m.latency.labels(endpoint).observe(time.perf_counter() - started.t0)
    if result.first_token_s is not None:
        m.ttft.labels(endpoint).observe(result.first_token_s)
    if answer.plan.mode == "feddpa" and len(result.adapter_weights) == 2:
        m.feddpa_weight.observe(result.adapter_weights[1])


def _answer(started: Started, i: int, result: GenerationResult) -> Answer:
    return Answer(started.choices[i], started.submitted[i].plan, result)


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone away (the ASGI ``http.disconnect`` message).

    The request body was read already: the next message is the disconnect, which the server sends
    when the client closes the connection (or after the response went out).
    """
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(state: ServerState, started: Started, shape: Shape, stream: bool,
                  include_usage: bool = False, receive: Receive | None = None,
                  select: Callable[[list[Answer]], list[Answer]] | None = None) -> Response:
    """The JSON response once every choice finished, or the SSE stream.

    Args:
        select: keeps the answers the response shows (``best_of``: :func:`serving.openai.responses.best_of`);
            every choice counts in the metrics.
        receive: the request's ASGI receive channel: when the client goes away before every choice
            finished, every choice is cancelled (its engine row freed at the next step) and nothing is
            answered, as the stream does.
    """
    if stream:
        return sse(state, started, shape, include_usage)
    results = asyncio.ensure_future(asyncio.gather(*(sub.handle.aresult() for sub in started.submitted)))
    gone = asyncio.ensure_future(disconnected(receive)) if receive is not None else None
    try:
        await asyncio.wait([t for t in (results, gone) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone is not None:
            gone.cancel()
        started.cancel()  # the client went away (or a choice failed): free the engine rows
        if not results.done():
            results.cancel()
    if not results.done() or results.cancelled():
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    answers = [_answer(started, i, r) for i, r in enumerate(results.result())]
    for a in answers:
        record(state, started, a, shape.endpoint)
    return JSONResponse(shape.body(select(answers) if select is not None else answers))


async def merged(started: Started) -> AsyncIterator[tuple[int, str | None]]:
    """(choice, text delta) from every choice as they come; (choice, None) when that choice ends."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for delta in started.submitted[i].handle.astream():
                await queue.put((i, delta))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(started.submitted))]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            left -= item[1] is None
            yield item
    finally:
        for task in tasks:
            task.cancel()


def sse(state: ServerState, started: Started, shape: Shape, include_usage: bool) -> StreamingResponse:
    """Stream ``data: {chunk}`` events, then ``data: [DONE]``; a disconnect cancels every choice."""

    async def events() -> AsyncIterator[str]:
        answers: list[Answer] = []
        try:
            for choice in started.choices:
                yield f"data: {json.dumps(shape.start(choice))}\n\n"
            async for i, delta in merged(started):
                if delta is not None:
                    event = shape.delta(started.choices[i], delta)  # None: held back for the last event
                    if event is not None:
                        yield f"data: {json.dumps(event)}\n\n"
                    continue
                answer = _answer(started, i, await started.submitted[i].handle.aresult())
                yield f"data: {json.dumps(shape.end(answer))}\n\n"
                answers.append(answer)
                record(state, started, answer, shape.endpoint)
            if include_usage:
                tail = {**shape.start(started.choices[0]), "choices": [], "usage": usage(answers)}
                yield f"data: {json.dumps(tail)}\n\n"
        except Exception as exc:  # headers are sent; report in-band as OpenAI does
            yield f"data: {json.dumps(error_payload(exc)[1])}\n\n"
        finally:
            started.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def details(state: ServerState, caller: Principal) -> bool:
    """Whether this caller's responses carry FedDPA routing details."""
    return state.routing_details(caller)


def head(started: Started, model: str) -> dict[str, Any]:
    """The fields every body and chunk of a response shares."""
    return {"id": started.response_id, "created": started.created, "model": model}

