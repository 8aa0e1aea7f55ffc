"""``create_app(settings)``: the FastAPI app, whose lifespan loads the model, adapters and engine.

Loading runs in a thread of its own that then ends (:func:`in_own_thread`), so the server answers at
once: ``/health`` is 503 (OpenAI error envelope) until the engine is ready, then 200. Request bodies
above ``max_body_bytes`` are refused with 413 before any parsing. The engine runs in its own
background thread for the app's lifetime, the only long-lived thread running torch's parallel work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from routing.instance import check_run_pooling
from serving.access import KeyRing
from serving.api import errors, openapi
from serving.api.dependencies import ServerState
from serving.api.openapi import package_version
from serving.api.routes import adapters, chat, completions, health, models, run_files, tokens
from serving.api.server import hide_query_strings
from serving.engine.host_work import StepProfiler
from serving.openai.compat import FieldPolicy, generation_defaults
from serving.settings import ServeSettings
from serving.stack import build_stack, stack_config
from serving.targets import WeightRouter

logger = logging.getLogger(__name__)


def build_state(state: ServerState, router: WeightRouter | None = None) -> None:
    """Build the serving stack (:mod:`serving.stack`) and start the engine (blocking)."""
    stack = build_stack(stack_config(state.settings), router)
    engine, pool = stack.engine, stack.pool
    state.stack = stack
    state.base_name = stack.base_name
    state.resolver = stack.resolver
    state.engine, state.pool, state.run = engine, pool, stack.run_info
    state.sampling_defaults = generation_defaults(state.settings.generation_config,
                                                  getattr(stack.loaded.model, "generation_config", None))
    state.metrics.bind(lambda: engine.stats().waiting, lambda: engine.stats().running, pool.loaded_count,
                       lambda: (engine.prefixes.hits, engine.prefixes.reused_tokens))
    engine.step_observers.append(state.metrics.observe_step)
    if state.settings.profile_dir is not None:
        engine.step_observers.append(StepProfiler(state.settings.profile_dir))
    state.metrics.capacity(engine.config.max_batch_size, engine.config.max_model_len,
                           engine.kv.bytes_for(engine.config.max_model_len))
    if state.settings.exit_on_engine_failure:
        engine.on_failure.append(_exit_soon)
    engine.start()
    state.created = int(time.time())
    state.ready = True


ENGINE_FAILED_EXIT = 70  # EX_SOFTWARE: the process exits so that its supervisor starts a fresh one


def _exit_soon(reason: str, grace_s: float = 2.0) -> None:
    """Exit the process after ``grace_s`` (error responses already answered get flushed meanwhile).

    A dead engine thread usually means a device fault (a CUDA error leaves the context unusable) or a
    bug; a fresh process is the only reliable recovery, so the server exits with status 70 and relies
    on its supervisor (Docker's restart policy, systemd, Kubernetes) while ``/health`` says 503.
    """

    def go() -> None:
        time.sleep(grace_s)
        logger.critical("exiting with status %d: %s", ENGINE_FAILED_EXIT, reason)
        logging.shutdown()
        os._exit(ENGINE_FAILED_EXIT)

    threading.Thread(target=go, name="fedmosaic-exit", daemon=True).start()


def _build_logged(state: ServerState, router: WeightRouter | None) -> None:
    try:
        build_state(state, router)
    except Exception as exc:  # reported by /health and every endpoint
        logger.exception("loading the model failed")
        state.load_error = f"{type(exc).__name__}: {exc}"


async def in_own_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` in a new thread, awaiting it without blocking the loop; returns once it ended.

    Not the loop's executor: a long-lived pool thread that ran torch's multi-threaded operations (the
    model load) keeps its OpenMP worker team, and with a second team (the engine thread's) libgomp
    counts more threads than cores and stops spinning between parallel regions, so each operation of
    every engine step waits for a sleeping worker (decode steps took 2x as long). A thread
    that ends frees its team.

    Raises:
        Exception: whatever ``fn`` raised.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if exc is None else done.set_exception(exc)

    def go() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    thread = threading.Thread(target=go, name="fedmosaic-load", daemon=True)
    thread.start()
    try:
        await done
    finally:
        if done.done():  # it has handed its outcome over: ending takes microseconds
            thread.join(1.0)


class BodyLimit:
    """ASGI middleware: answer 413 (error envelope) to bodies over ``limit`` bytes, declared or streamed,
    and 408 to a body still incomplete ``timeout`` seconds after the request head."""

    def __init__(self, app: Any, limit: int, timeout: float | None = None) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks, total, more = [], 0, True
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else deadline - time.monotonic())
            except TimeoutError:
                response = errors.envelope(408, f"the request body did not arrive within {self.timeout} s",
                                           "RequestTimeout", "request_timeout", headers={"Connection": "close"})
                await response(scope, receive, send)
                return
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
            return await receive()

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

    Raises:
        AccessConfigError: a key file or the key binding file is unreadable or malformed.
        RoutingError: the run's FedDPA indexes were pooled otherwise than ``feddpa_embedding`` asks
            (checked here, so the server refuses to start instead of failing every request).
    """
    settings = settings or ServeSettings()
    if settings.run_dir is not None and router is None and settings.feddpa_options().instance:
        check_run_pooling(settings.run_dir, settings.feddpa_embedding)
    if settings.generation_config not in ("auto", "vllm"):
        generation_defaults(settings.generation_config)  # a folder's file is read now: refused before serving
    keys = KeyRing.build(settings.api_keys, settings.admin_keys, settings.api_key_file, settings.admin_key_file,
                         settings.key_bindings)
    if keys.open and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without any API key: anyone who reaches it may use every target",
                       settings.host)
    state = ServerState(settings=settings, keys=keys, fields=FieldPolicy(settings.strict_fields))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hide_query_strings()  # after the server configured its logging: keys in query strings never logged
        loading = asyncio.ensure_future(in_own_thread(_build_logged, state, router))
        try:
            yield
        finally:
            await loading
            if state.engine is not None:
                await asyncio.get_running_loop().run_in_executor(None, state.engine.stop,
                                                                 settings.shutdown_timeout_s)

    app = FastAPI(title="fedmosaic", version=package_version(), lifespan=lifespan)
    app.state.server = state
    errors.install(app)
    openapi.install(app, secured=not keys.open)
    for module in (health, models, chat, completions, adapters, run_files, tokens):
        app.include_router(module.router)
    app.include_router(health.metrics_router(settings.protect_metrics, keyed=not keys.open))
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout=settings.body_timeout_s)
    if settings.allowed_origins:  # outermost: a preflight is answered before any other layer reads it
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app
