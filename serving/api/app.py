"""``create_app(settings)``: the FastAPI app, whose lifespan loads the model, adapters and engine.

Loading runs in a worker thread so the server answers at once: ``/health`` is 503 (OpenAI error
envelope) until the engine is ready, then 200. Request bodies above ``max_body_bytes`` are refused with
413 before any parsing. The engine runs in its own background thread for the app's lifetime.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from adapters import inject
from fedmosaic.models import load_base_model
from serving.adapter_pool import AdapterPool
from serving.api import errors
from serving.api.dependencies import ServerState
from serving.api.routes import adapters, chat, completions, health, models
from serving.engine import Engine, EngineConfig
from serving.settings import ServeSettings
from serving.targets import TargetResolver, WeightRouter

logger = logging.getLogger(__name__)


def build_state(state: ServerState, router: WeightRouter | None = None) -> None:
    """Load the base model, inject adapters, fill the pool and start the engine (blocking)."""
    s = state.settings
    loaded = load_base_model(s.model, dtype=s.dtype)  # type: ignore[arg-type]
    adapted = inject(loaded.model, s.target_modules)
    engine = Engine(loaded, adapted, EngineConfig(max_batch_size=s.max_batch_size, max_model_len=s.max_model_len,
                                                  max_waiting=s.max_waiting))
    specs = [spec.partition("=") for spec in s.adapters]
    root = s.adapter_root or s.run_dir
    if root is None and specs:
        root = Path(os.path.commonpath([str(Path(p).resolve()) for _, _, p in specs]))
    pool = AdapterPool(adapted, root=root, max_loras=s.max_loras, model_lock=engine.model_lock,
                       check_base=s.check_base)
    run = pool.load_run(s.run_dir) if s.run_dir is not None else None
    for name, _, path in specs:
        pool.load(name, path)
    alpha = run.inference_weight if run is not None and run.inference_weight is not None else s.default_alpha
    if router is None and run is not None and s.feddpa_routing == "instance" and _has_embeddings(s.run_dir):
        from serving.feddpa_router import InstanceWeightRouter

        router = InstanceWeightRouter.for_run(Path(s.run_dir), lambda_=alpha, S=s.feddpa_samples,  # type: ignore[arg-type]
                                              mode=s.feddpa_mode)
    state.base_name = s.served_model_name or s.model
    state.resolver = TargetResolver(state.base_name, pool, router, alpha)
    state.engine, state.pool, state.run = engine, pool, run
    state.metrics.bind(lambda: engine.stats().waiting, lambda: engine.stats().running, pool.loaded_count)
    engine.start()
    state.created = int(time.time())
    state.ready = True


def _has_embeddings(run_dir: Path | None) -> bool:
    clients = Path(run_dir) / "adapters" / "clients" if run_dir is not None else None
    return bool(clients and clients.is_dir() and any(clients.glob("*/embeddings.npy")))


def _build_logged(state: ServerState, router: WeightRouter | None) -> None:
    try:
        build_state(state, router)
    except Exception as exc:  # noqa: BLE001 - reported by /health and every endpoint
        logger.exception("loading the model failed")
        state.load_error = f"{type(exc).__name__}: {exc}"


class BodyLimit:
    """ASGI middleware: answer 413 (error envelope) to bodies over ``limit`` bytes, declared or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.limit:
                await self._refuse(scope, receive, send)
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # type: ignore[no-any-return]

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        response = errors.envelope(413, f"request body exceeds {self.limit} bytes", "RequestTooLarge",
                                   "request_too_large")
        await response(scope, receive, send)


def create_app(settings: ServeSettings | None = None, router: WeightRouter | None = None) -> FastAPI:
    """Build the OpenAI-compatible app.

    Args:
        settings: server settings (default: from the environment).
        router: a FedDPA weight router for ``<client>`` targets (default: the run's fixed weight).
    """
    settings = settings or ServeSettings()
    state = ServerState(settings=settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.get_running_loop().run_in_executor(None, _build_logged, state, router)
        try:
            yield
        finally:
            await loading
            if state.engine is not None:
                state.engine.stop()

    app = FastAPI(title="fedmosaic", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    errors.install(app)
    for module in (health, models, chat, completions, adapters):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
