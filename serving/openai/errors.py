"""The one place that maps errors to HTTP status codes and the OpenAI error envelope (no FastAPI).

``{"error": {"message", "type", "param", "code"}}`` with a string ``code``. Bad input is always a 4xx,
and an unexpected exception is the only source of a 500. The HTTP API installs these on its app
(:mod:`serving.api.errors`); the batch runner writes them on its output lines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adapters import AdapterError
from serving import errors
from serving.openai.schemas import ErrorBody, ErrorResponse

# exception class -> (status, OpenAI error type, code)
_DOMAIN: tuple[tuple[type[Exception], int, str, str], ...] = (
    (errors.ModelNotFound, 404, "NotFoundError", "model_not_found"),
    (errors.AdapterNotFound, 404, "NotFoundError", "adapter_not_found"),
    (errors.AdapterExists, 400, "BadRequestError", "adapter_exists"),
    (errors.AdapterPinned, 409, "ConflictError", "adapter_pinned"),
    (errors.NameReserved, 400, "BadRequestError", "name_reserved"),
    (errors.AdapterLoadFailed, 400, "BadRequestError", "adapter_load_failed"),
    (errors.PathNotAllowed, 403, "PermissionDeniedError", "path_not_allowed"),
    (errors.NoFreeSlot, 503, "ServiceUnavailableError", "no_free_adapter_slot"),
    (errors.EngineOverloaded, 429, "RateLimitError", "overloaded"),
    (errors.EngineNotReady, 503, "ServiceUnavailableError", "not_ready"),
    (errors.RequestTimedOut, 504, "GatewayTimeoutError", "timeout"),
    (errors.GenerationFailed, 500, "InternalServerError", "internal_error"),
    (errors.InvalidRequest, 400, "BadRequestError", "invalid_request"),
    (AdapterError, 400, "BadRequestError", "invalid_adapter"),
    (ValueError, 400, "BadRequestError", "invalid_request"),
)


def error_payload(exc: Exception) -> tuple[int, dict[str, object]]:
    """(status, envelope dict) for ``exc``; used by SSE streams that fail after the headers went out."""
    for cls, status, type_, code in _DOMAIN:
        if isinstance(exc, cls):
            param = getattr(exc, "param", None)
            return status, ErrorResponse(error=ErrorBody(message=str(exc), type=type_, param=param,
                                                         code=code)).model_dump()
    return 500, ErrorResponse(error=ErrorBody(message="internal server error", type="InternalServerError",
                                              code="internal_error")).model_dump()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union-member loc parts
_NAMED = ("unsupported", "extra_forbidden")  # errors that name a field this server refuses


def _param(loc: Sequence[Any]) -> str | None:
    """The request field of an error location, without ``body`` and union-member tags (``list[int]``)."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    return ".".join(parts) or None


def validation_payload(problems: Sequence[Mapping[str, Any]]) -> dict[str, object]:
    """The 400 envelope dict for pydantic validation errors.

    The first error names the ``param``, except that a refused field (unknown, or an OpenAI feature this
    server does not implement) is named first, so a union's other members never hide it.
    """
    first = next((p for p in problems if p.get("type") in _NAMED), problems[0] if problems else {})
    param = _param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = ("unknown field: not an OpenAI or vLLM parameter this server implements (see the "
               "parameter table in docs/serving.md)")
    message = f"{param}: {msg}" if param else msg
    return ErrorResponse(error=ErrorBody(message=message, type="BadRequestError", param=param,
                                         code="invalid_request")).model_dump()
