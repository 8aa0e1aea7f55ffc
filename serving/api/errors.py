"""FastAPI's exception handlers: every error leaves as the OpenAI error envelope.

The mapping of errors to a status and an envelope is :mod:`serving.openai.errors` (shared with the
batch runner); here it is installed on the app. Bad input is always a 4xx: FastAPI's request
validation errors become 400 (not its default 422), and an unexpected exception is the only source of
a 500. No error closes a keep-alive connection: Starlette's outermost handler re-raises after
answering, and uvicorn closes the connection of any request whose app raised, so :class:`CatchAll`
answers the 500 itself and the exception ends there.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters import AdapterError
from serving import errors
from serving.openai.errors import error_payload, validation_payload
from serving.openai.schemas import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)

_HTTP = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "MethodNotAllowed", 409: "ConflictError", 413: "RequestTooLarge", 429: "RateLimitError",
         503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def envelope(status: int, message: str, type_: str, code: str | None, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    """Return the OpenAI error envelope as a JSON response."""
    body = ErrorResponse(error=ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# Starlette types every handler as taking an Exception: the two below narrow to the class they are installed for.
def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(validation_payload(exc.errors()), status_code=400)


def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
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
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(errors.ServingError, _domain)
    app.add_exception_handler(AdapterError, _domain)
    app.add_exception_handler(ValueError, _domain)
    app.add_exception_handler(Exception, _domain)
    app.add_middleware(CatchAll)
