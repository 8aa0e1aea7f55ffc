"""OpenAI request bodies -> engine inputs, and engine results -> OpenAI response bodies.

Shared by the HTTP routes (:mod:`serving.api.routes`) and the offline batch runner
(:mod:`serving.batch`), so a batch-file line and an HTTP request with the same body get the same
prompt, the same sampling parameters and the same response JSON (ids and timestamps aside).
Pure functions: no FastAPI, no server state.
"""

from __future__ import annotations

from typing import Any

from serving.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from serving.errors import EngineNotReady, GenerationFailed, InvalidRequest, RequestTimedOut
from serving.request import GenerationResult
from serving.sampling import SamplingParams
from serving.targets import TargetPlan


def chat_prompt(tokenizer: object, body: ChatCompletionRequest) -> str:
    """The chat-templated prompt of ``body`` (with the assistant turn opened).

    Raises:
        InvalidRequest: the tokenizer's chat template rejects the messages.
    """
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return str(tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # noqa: BLE001 - templates raise on unsupported role orders
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc


def completion_prompt(body: CompletionRequest) -> str:
    """The single raw prompt of a completion request (no template).

    Raises:
        InvalidRequest: a batch of prompts (send one per request).
    """
    try:
        return body.prompt_text()
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="prompt") from exc


def requested_max_tokens(body: SamplingFields) -> int | None:
    """``max_completion_tokens`` when a chat request sets it, else ``max_tokens``."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def sampling_params(body: SamplingFields, limit: int, default: int) -> SamplingParams:
    """The engine's sampling parameters, with the server's token limits applied.

    Args:
        body: the request.
        limit: the largest ``max_tokens`` allowed.
        default: ``max_tokens`` when the request sets none (capped at ``limit``).

    Raises:
        InvalidRequest: ``max_tokens`` above ``limit``.
    """
    asked = requested_max_tokens(body)
    tokens = asked if asked is not None else min(default, limit)
    if tokens > limit:
        raise InvalidRequest(f"max_tokens is {tokens}; this server allows at most {limit}", param="max_tokens")
    return SamplingParams(max_tokens=tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(body.top_k, 0), stop=body.stop_strings(), seed=body.seed)


def usage(result: GenerationResult) -> dict[str, int]:
    """The OpenAI usage object."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def extension(plan: TargetPlan, result: GenerationResult | None) -> dict[str, Any]:
    """The ``fedmosaic`` response field: mode, weights used per adapter, routing info."""
    # an AMoLE client decodes with its route, no plain adapters: its plan's weight (1 on the client) stands
    weights = result.adapter_weights if result is not None and plan.mode != "amole" else plan.weights
    info = dict(result.route_info) if result is not None and result.route_info else dict(plan.info or {})
    return {"mode": plan.mode, "weights": dict(zip(plan.names, weights, strict=True)), "info": info}


def finish_reason(result: GenerationResult) -> str:
    """The OpenAI finish reason; an engine error, deadline or shutdown surfaces as its domain error.

    Raises:
        InvalidRequest: the request caused the failure (400).
        RequestTimedOut: the server's deadline passed (504).
        GenerationFailed: the server failed (500; the message names the request id).
        EngineNotReady: the request was cancelled by a shutdown (503).
    """
    if result.finish_reason == "error":
        message = result.error or f"generation of request {result.request_id} failed"
        if result.error_status == 400:
            raise InvalidRequest(message)
        if result.error_status == 504:
            raise RequestTimedOut(message)
        raise GenerationFailed(message)
    if result.finish_reason == "cancelled":
        raise EngineNotReady("the request was cancelled (server shutting down)")
    return result.finish_reason


def chat_body(response_id: str, created: int, model: str, plan: TargetPlan, result: GenerationResult
              ) -> dict[str, Any]:
    """A ``chat.completion`` response body."""
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "logprobs": None, "finish_reason": finish_reason(result)}],
        "usage": usage(result), "fedmosaic": extension(plan, result),
    }


def completion_body(response_id: str, created: int, model: str, plan: TargetPlan, result: GenerationResult,
                    echo: str = "") -> dict[str, Any]:
    """A ``text_completion`` response body (``echo``: the prompt, when the request asked for it)."""
    return {
        "id": response_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": echo + result.text, "logprobs": None,
                     "finish_reason": finish_reason(result)}],
        "usage": usage(result), "fedmosaic": extension(plan, result),
    }
