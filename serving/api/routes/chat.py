"""POST /v1/chat/completions (JSON or SSE)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from serving.api import builders, service
from serving.api.dependencies import State, require_api_key
from serving.api.protocol import ChatCompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, state: State) -> Response:
    """OpenAI chat completions over the base model, an adapter, a FedDPA client or a mixture."""
    assert state.engine is not None
    params = service.sampling_params(body, state)
    prompt = builders.chat_prompt(state.engine.tokenizer, body)
    started = await service.start(state, body, prompt, params, "chatcmpl")
    head: dict[str, Any] = {"id": started.response_id, "created": started.created, "model": body.model}

    if body.stream:
        def chunk(delta: str | None, finish: str | None) -> dict[str, Any]:
            piece: dict[str, Any] = {}
            if delta == "":
                piece = {"role": "assistant", "content": ""}
            elif delta is not None:
                piece = {"content": delta}
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish}]}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return service.sse(state, started, "chat", chunk, include)

    result = await service.complete(state, started, "chat")
    return JSONResponse(builders.chat_body(started.response_id, started.created, body.model, started.plan, result))
