"""The endpoints clients probe beside OpenAI's: ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes),
``GET /version`` and ``GET /ping`` (vLLM's and SageMaker's liveness probe: ``/health``'s answer)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from serving.access import Principal
from serving.api.dependencies import Caller, ServerState, State
from serving.api.openapi import errors, package_version
from serving.api.routes.health import health
from serving.errors import InvalidRequest, ModelNotFound
from serving.openai import builders, chat_format
from serving.openai.schemas import ChatCompletionRequest
from serving.openai.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

router = APIRouter()


class Version(BaseModel):
    version: str


def _target(state: ServerState, caller: Principal, model: str | None) -> str:
    """The served name a tokenize request names (the base model by default).

    Raises:
        ModelNotFound: a name not served here, or outside the caller's binding.
    """
    assert state.resolver is not None
    name = model or state.base_name
    if not caller.allows(name, state.base_name) or not state.resolver.serves(name):
        raise ModelNotFound(f"the model {name!r} does not exist (GET /v1/models lists what this key may use)")
    return name


def _chat_text(state: ServerState, body: TokenizeChatRequest, model: str) -> str:
    """The prompt ``/v1/chat/completions`` would send for these messages to ``model``."""
    assert state.engine is not None
    try:
        chat = ChatCompletionRequest.model_validate({
            "model": model, "messages": body.messages, "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message, "chat_template_kwargs": body.chat_template_kwargs})
    except ValidationError as exc:
        problem = exc.errors()[0]
        field = str(problem["loc"][0]) if problem["loc"] else None
        raise InvalidRequest(f"{field}: {problem['msg'].removeprefix('Value error, ')}", param=field) from exc
    style = chat_format.trained_style(state.stack, model)
    if style is not None:
        return chat_format.trained_prompt(chat.messages, style, bool(body.continue_final_message))
    return builders.chat_prompt(state.engine.tokenizer, chat)


@router.post("/tokenize", responses=errors(400, 401, 404, 413, 503))
async def tokenize_prompt(caller: Caller, body: TokenizeCompletionRequest | TokenizeChatRequest,
                          state: State) -> TokenizeResponse:
    """vLLM's tokenizer endpoint: a completion's ``prompt`` or a chat's ``messages`` (rendered for ``model``
    as chat completions render them) -> token ids, their count and the server's ``max_model_len``."""
    assert state.engine is not None
    model = _target(state, caller, body.model)
    engine = state.engine
    if isinstance(body, TokenizeChatRequest):
        text = await run_in_threadpool(_chat_text, state, body, model)
    else:
        text = body.prompt
    return await run_in_threadpool(tokenize, engine.tokenizer, text, body.add_special_tokens, body.return_token_strs,
                                   engine.config.max_model_len)


@router.post("/detokenize", responses=errors(400, 401, 404, 413, 503))
async def detokenize_tokens(caller: Caller, body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    """vLLM's detokenizer endpoint: token ids -> text (special tokens kept)."""
    assert state.engine is not None
    _target(state, caller, body.model)
    return await run_in_threadpool(detokenize, state.engine.tokenizer, body.tokens)


@router.get("/version")
def version() -> Version:
    """The server's version (the ``fedmosaic`` package's), as vLLM's ``GET /version``."""
    return Version(version=package_version())


@router.get("/ping", response_model=None,
            responses={200: {"description": "serving", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"status": {"type": "string"}}}}}}, **errors(503)})
def ping(request: Request) -> JSONResponse:
    """The same answer as ``GET /health`` (vLLM serves ``/ping`` for SageMaker's probe)."""
    return health(request)
