"""What the OpenAPI document says a route answers: every status with the OpenAI error model.

Routes declare ``responses={**json(), **errors(400, 401, ...)}`` with the statuses they can answer;
:func:`install` drops FastAPI's automatic 422 entries (this server answers validation errors with
400). A method a path does not serve gets 405 with an ``Allow`` header.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serving.openai.schemas import ErrorResponse

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
WHY = {
    400: "invalid request (the message and `param` name the field)",
    401: "missing or unknown API key",
    403: "the key may not do this (admin operations), or a path outside the allowed folder",
    404: "unknown model or target (also one the key is not bound to), adapter, file or disabled endpoint",
    409: "conflict: a pinned adapter needs `force` to be unloaded",
    413: "request body too large",
    429: "the waiting queue is full; retry later",
    500: "the server failed while generating (the message names the request id)",
    503: "the model is loading, the engine failed or shuts down, or no adapter slot is free",
    504: "the request outlived the server's deadline",
}


def package_version() -> str:
    """The installed ``fedmosaic`` version (the OpenAPI document's, ``GET /version``'s); ``0+unknown`` in a
    source tree used without installing it."""
    try:
        return metadata.version("fedmosaic")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses`` entries for ``statuses``, each with the error envelope's schema."""
    return {s: {"model": ErrorResponse, "description": WHY[s]} for s in statuses}


def text(media_type: str = "text/plain", description: str = "Successful Response") -> dict[int | str, dict[str, Any]]:
    """A 200 answered as text of ``media_type``."""
    return {200: {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}}


def _completion(objects: list[str]) -> dict[str, Any]:
    """The fields every completion body or chunk has (``object`` one of ``objects``)."""
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"enum": objects}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}},
                           "usage": {"type": "object"}, "fedmosaic": {"type": "object"}}}


# One server-sent event as Open API 3.1 tools read an event stream's ``schema`` (3.2's ``itemSchema``):
# its ``data`` is a JSON chunk, the error envelope when a choice fails after the headers went out, or
# ``[DONE]``, always last.
SSE_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {
        "data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [_completion(["chat.completion.chunk", "text_completion"]), ERROR_REF]}},
        ]},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
    },
}


def json_or_sse() -> dict[int | str, dict[str, Any]]:
    """A 200 answered as JSON, or as server-sent events (:data:`SSE_EVENT` each) when the request streams."""
    return {200: {"description": "the completion (JSON), or with `stream: true` server-sent events, each a "
                                 "`data:` line holding one JSON chunk, the last `data: [DONE]`",
                  "content": {"application/json": {"schema": _completion(["chat.completion", "text_completion"])},
                              "text/event-stream": {"schema": SSE_EVENT}}}}


def _limits(components: dict[str, Any], app: FastAPI) -> None:
    """Write this server's limits into the request schemas (``max_tokens``, ``n``)."""
    settings = getattr(getattr(app.state, "server", None), "settings", None)
    if settings is None:
        return
    bounds = {"max_tokens": settings.max_tokens_limit, "max_completion_tokens": settings.max_tokens_limit,
              "n": settings.max_choices}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        for field, bound in bounds.items():
            prop = components.get(name, {}).get("properties", {}).get(field)
            for option in (prop or {}).get("anyOf", [prop] if prop else []):
                if option.get("type") == "integer":
                    option["maximum"] = min(bound, option.get("maximum", bound))
            if prop is not None and isinstance(prop.get("default"), int) and prop["default"] > bound:
                prop["default"] = bound


def install(app: FastAPI, secured: bool) -> None:
    """Replace ``app.openapi`` with the document described in the module docstring (built once).

    Args:
        app: the app.
        secured: keys are configured; without any, no operation requires the bearer scheme.
    """

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    ok = responses.get("200", {}).get("content", {})
                    if len(ok) > 1 and not ok.get("application/json", {}).get("schema"):
                        ok.pop("application/json", None)  # FastAPI's default beside the declared media type
                    for status, response in responses.items():
                        if status != "200":  # every error is the JSON envelope, whatever the 200 is
                            response["content"] = {"application/json": {"schema": ERROR_REF}}
                    if not secured:
                        operation.pop("security", None)
                        responses.pop("401", None)
            components = schema.get("components", {}).get("schemas", {})
            _limits(components, app)
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            if not secured:
                schema.get("components", {}).pop("securitySchemes", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
