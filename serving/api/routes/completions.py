"""POST /v1/completions (JSON or SSE): raw prompt text, no chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from serving.api import builders, service
from serving.api.dependencies import State, require_api_key
from serving.api.protocol import CompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, state: State) -> Response:
    """OpenAI (legacy) completions; one prompt per request."""
    prompt = builders.completion_prompt(body)
    params = service.sampling_params(body, state)
    started = await service.start(state, body, prompt, params, "cmpl")
    head: dict[str, Any] = {"id": started.response_id, "object": "text_completion", "created": started.created,
                            "model": body.model}
    echo = prompt if body.echo else ""

    if body.stream:
        def chunk(delta: str | None, finish: str | None) -> dict[str, Any]:
            text = echo if delta == "" else (delta or "")
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return service.sse(state, started, "completions", chunk, include)

    result = await service.complete(state, started, "completions")
    return JSONResponse(builders.completion_body(started.response_id, started.created, body.model, started.plan,
                                                 result, echo))
