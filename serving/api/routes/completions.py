"""POST /v1/completions (JSON or SSE): raw prompts (text or token ids, one or a batch), no chat template."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from serving.api import service
from serving.api.dependencies import Caller, State
from serving.api.openapi import errors, json_or_sse
from serving.openai import builders, compat
from serving.openai.responses import CompletionShape, best_of
from serving.openai.schemas import CompletionRequest

router = APIRouter()


@router.post("/v1/completions", response_model=None,
             responses={**json_or_sse(), **errors(400, 401, 404, 413, 429, 500, 503, 504)})
async def completions(request: Request, caller: Caller, body: CompletionRequest, state: State) -> Response:
    """OpenAI (legacy) completions; a batch of prompts is answered as ``choices`` with their ``index``."""
    assert state.engine is not None
    service.check_access(state, caller, body)
    # templating and tokenizing a long prompt takes a while: off the event loop
    choices = await run_in_threadpool(builders.choices, body, state.engine.tokenizer, service.limits(state))
    started = await service.start(state, body, choices, "cmpl", caller)
    shape = CompletionShape(state.engine.tokenizer, service.head(started, body.model),
                            service.details(state, caller), body.logprobs)
    include = bool(body.stream_options and body.stream_options.include_usage)
    select = (functools.partial(best_of, n=body.n or 1, per_prompt=compat.candidates(body))
              if compat.picks_best(body) else None)  # best_of: the n most likely of the candidates
    return await service.respond(state, started, shape, bool(body.stream), include, request.receive, select)
