"""The one place that maps errors to HTTP status codes and the OpenAI error envelope.

``{"error": {"message", "type", "param", "code"}}`` with a string ``code``. Bad input is always a 4xx:
FastAPI's request validation errors become 400 (not its default 422), and an unexpected exception is
the only source of a 500. No error closes a keep-alive connection: Starlette's outermost handler
re-raises after answering, and uvicorn closes the connection of any request whose app raised, so
:class:`CatchAll` answers the 500 itself and the exception ends there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters import AdapterError
from serving import errors
from serving.api.protocol import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)

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

_HTTP = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "MethodNotAllowed", 409: "ConflictError", 413: "RequestTooLarge", 429: "RateLimitError",
         503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def envelope(status: int, message: str, type_: str, code: str | None, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    """Return the OpenAI error envelope as a JSON response."""
    body = ErrorResponse(error=ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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
        msg = ("unknown field: not an OpenAI or vLLM parameter this server implements (see the README's "
               "parameter table)")
    message = f"{param}: {msg}" if param else msg
    return ErrorResponse(error=ErrorBody(message=message, type="BadRequestError", param=param,
                                         code="invalid_request")).model_dump()


def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_payload(exc.errors()), status_code=400)


def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "unauthorized" if exc.status_code == 401 else None
    return envelope(exc.status_code, str(exc.detail), _HTTP.get(exc.status_code, "Error"), code,
                    headers=getattr(exc, "headers", None))


def _domain(_: Request, exc: Exception) -> JSONResponse:
    status, body = error_payload(exc)
    if status == 500:
        logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(body, status_code=status)


class CatchAll:
    """ASGI middleware: an unexpected exception is logged and answered 500 (the envelope), not re-raised.

    Only a response already started (a stream failing mid-way) re-raises: ending it needs the
    connection closed.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error", exc_info=exc)
            status, body = error_payload(exc)
            await JSONResponse(body, status_code=status)(scope, receive, send)


def install(app: FastAPI) -> None:
    """Register every handler on ``app``."""
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(errors.ServingError, _domain)
    app.add_exception_handler(AdapterError, _domain)
    app.add_exception_handler(ValueError, _domain)
    app.add_exception_handler(Exception, _domain)
    app.add_middleware(CatchAll)
