"""GET /health (503 until the engine is ready) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from serving.api.dependencies import ServerState
from serving.api.errors import envelope

router = APIRouter()


@router.get("/health", response_model=None)
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


@router.get("/metrics")
def metrics(request: Request) -> Response:
    """Prometheus exposition of the server's metrics."""
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
