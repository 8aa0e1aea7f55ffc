"""POST /v1/chat/completions (JSON or SSE)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from serving.api import service
from serving.api.dependencies import ServerState, State, require_api_key
from serving.api.protocol import ChatCompletionRequest
from serving.errors import InvalidRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


def _prompt(state: ServerState, body: ChatCompletionRequest) -> str:
    assert state.engine is not None
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return str(state.engine.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # noqa: BLE001 - templates raise on unsupported role orders
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, state: State) -> Response:
    """OpenAI chat completions over the base model, an adapter, a FedDPA client or a mixture."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = service.sampling_params(body, max_tokens, state)
    started = await service.start(state, body, _prompt(state, body), params, "chatcmpl")
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
    return JSONResponse({
        **head, "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "logprobs": None, "finish_reason": service.finish_reason(result)}],
        "usage": service.usage(result), "fedmosaic": service.extension(started, result),
    })
