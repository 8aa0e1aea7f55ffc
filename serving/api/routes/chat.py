"""POST /v1/chat/completions (JSON or SSE)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from serving.api import service
from serving.api.dependencies import Caller, State
from serving.api.openapi import errors, json_or_sse
from serving.openai import builders, chat_format
from serving.openai.responses import ChatShape
from serving.openai.schemas import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None,
             responses={**json_or_sse(), **errors(400, 401, 404, 413, 429, 500, 503, 504)})
async def chat_completions(request: Request, caller: Caller, body: ChatCompletionRequest, state: State) -> Response:
    """OpenAI chat completions over the base model, an adapter, a FedDPA client or a mixture."""
    assert state.engine is not None
    service.check_access(state, caller, body)
    # a run's target answers chat in the template its adapters trained with (serving.openai.chat_format)
    style = chat_format.trained_style(state.stack, body.model, body.mixture())
    # templating and tokenizing a long prompt takes a while: off the event loop
    choices = await run_in_threadpool(builders.choices, body, state.engine.tokenizer, service.limits(state), style)
    started = await service.start(state, body, choices, "chatcmpl", caller)
    k = (body.top_logprobs or 0) if body.logprobs else None
    shape = ChatShape(state.engine.tokenizer, service.head(started, body.model), service.details(state, caller), k)
    include = bool(body.stream_options and body.stream_options.include_usage)
    return await service.respond(state, started, shape, bool(body.stream), include, request.receive)
