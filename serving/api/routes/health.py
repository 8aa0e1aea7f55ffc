"""GET /health (503 until the engine is ready) and GET /metrics (Prometheus text, optionally admin-only)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from serving.api.dependencies import Admin, AdminKey, ServerState
from serving.api.errors import envelope
from serving.api.openapi import errors, text

router = APIRouter()


@router.get("/health", response_model=None,
            responses={200: {"description": "serving", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"status": {"type": "string"}}}}}}, **errors(503)})
def health(request: Request) -> JSONResponse:
    """200 ``{"status": "ok"}`` once serving; 503 with the error envelope while loading, after the engine
    failed (the reason in the message) or while shutting down."""
    state: ServerState = request.app.state.server
    if not state.ready:
        message = f"model failed to load: {state.load_error}" if state.load_error else "the model is still loading"
        return envelope(503, message, "ServiceUnavailableError", "not_ready")
    problem = state.engine.health() if state.engine is not None else None
    if problem is not None:
        return envelope(503, problem, "ServiceUnavailableError", "engine_failed")
    return JSONResponse({"status": "ok"})


def _render(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def metrics_router(protected: bool, keyed: bool = False) -> APIRouter:
    """``GET /metrics``: Prometheus exposition text.

    Args:
        protected: it needs an admin key (on a server without admin keys: any unbound key).
        keyed: keys are configured: it needs an admin key, always. Its counters are totals over every
            tenant (prompt-prefix reuse included), which tenants must not read between their requests.
    """
    metrics = APIRouter()
    content = text(CONTENT_TYPE_LATEST.split(";")[0], f"Prometheus exposition text ({CONTENT_TYPE_LATEST})")
    if keyed:
        @metrics.get("/metrics", response_model=None, responses={**content, **errors(401, 403)})
        def admin_metrics(request: Request, caller: AdminKey) -> Response:
            """Prometheus exposition of the server's metrics (admin keys only on a server with keys)."""
            return _render(request)
    elif protected:
        @metrics.get("/metrics", response_model=None, responses={**content, **errors(401, 403)})
        def protected_metrics(request: Request, caller: Admin) -> Response:
            """Prometheus exposition of the server's metrics (admin keys only on this server)."""
            return _render(request)
    else:
        @metrics.get("/metrics", response_model=None, responses=content)
        def open_metrics(request: Request) -> Response:
            """Prometheus exposition of the server's metrics."""
            return _render(request)
    return metrics
