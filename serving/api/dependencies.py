"""Request-scoped access to the server state (engine, pool, resolver) and the API-key check.

Handlers get everything through these dependencies, so tests can override them
(``app.dependency_overrides``) and nothing reaches for globals.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from serving.adapter_pool import AdapterPool, RunInfo
from serving.api.metrics import Metrics
from serving.engine import Engine
from serving.errors import EngineNotReady
from serving.settings import ServeSettings
from serving.stack import ServingStack
from serving.targets import TargetResolver


@dataclass(eq=False)
class ServerState:
    """What the lifespan builds; ``ready`` turns True once the model and adapters are loaded."""

    settings: ServeSettings
    metrics: Metrics = field(default_factory=Metrics)
    stack: ServingStack | None = None
    engine: Engine | None = None
    pool: AdapterPool | None = None
    resolver: TargetResolver | None = None
    run: RunInfo | None = None
    base_name: str = ""
    created: int = 0
    ready: bool = False
    load_error: str | None = None


def get_state(request: Request) -> ServerState:
    """The app's state, ready to serve.

    Raises:
        EngineNotReady: the model is still loading or failed to load.
    """
    state: ServerState = request.app.state.server
    if not state.ready:
        raise EngineNotReady(state.load_error or "the model is still loading; retry shortly")
    return state


def get_settings(request: Request) -> ServeSettings:
    """The server settings (available while loading too)."""
    return request.app.state.server.settings  # type: ignore[no-any-return]


def require_api_key(request: Request) -> None:
    """Check ``Authorization: Bearer <key>`` when API keys are configured.

    Raises:
        HTTPException: 401 on a missing or wrong key.
    """
    keys = get_settings(request).api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip(), k) for k in keys):
        raise HTTPException(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                            headers={"WWW-Authenticate": "Bearer"})


# Handlers declare ``state: State`` (FastAPI's Annotated dependency style).
State = Annotated[ServerState, Depends(get_state)]
