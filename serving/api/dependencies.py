"""Request-scoped access to the server state (engine, pool, resolver), the caller and its role.

Handlers get everything through these dependencies, so nothing reaches for globals: the state lives on
the app that ``create_app`` built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serving.access import KeyRing, Principal
from serving.api.prometheus import Metrics
from serving.engine import Engine
from serving.errors import EngineNotReady
from serving.openai.compat import FieldPolicy, SamplingDefaults
from serving.pool import AdapterPool, RunInfo
from serving.settings import ServeSettings
from serving.stack import ServingStack
from serving.targets import TargetResolver


@dataclass(eq=False)
class ServerState:
    """What the lifespan builds; ``ready`` turns True once the model and adapters are loaded."""

    settings: ServeSettings
    keys: KeyRing = field(default_factory=KeyRing)
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
    fields: FieldPolicy = field(default_factory=FieldPolicy)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def runtime_lora(self) -> bool:
        """True when runtime adapter loading is on (the setting, else: an admin key is configured)."""
        enabled = self.settings.allow_runtime_lora
        return self.keys.has_admins if enabled is None else enabled

    def routing_details(self, caller: Principal) -> bool:
        """True when ``caller``'s responses carry FedDPA routing details (similarities, S, lambda)."""
        shown = self.settings.routing_details
        return shown == "all" or (shown == "admin" and caller.admin)


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
    return request.app.state.server.settings


_bearer = HTTPBearer(auto_error=False, description="an API key: a user key (inference) or an admin key")


def get_caller(request: Request,
               credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    """The caller of this request, from ``Authorization: Bearer <key>``.

    Any caller passes on a server without keys (the anonymous user).

    Raises:
        HTTPException: 401 on a missing, malformed or unknown key (a non-ASCII one included).
    """
    keys: KeyRing = request.app.state.server.keys
    token = credentials.credentials.strip() if credentials is not None else ""
    # header values are latin-1 text: these are the bytes the client sent, compared as bytes
    principal = keys.identify(token.encode("latin-1", errors="replace") if token else None)
    if principal is None:
        raise HTTPException(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                            headers={"WWW-Authenticate": "Bearer"})
    return principal


def admin_allowed(keys: KeyRing, caller: Principal) -> bool:
    """True when ``caller`` may use admin operations.

    With admin keys configured only they may; without any, every unbound caller who passed the key check
    may (a single-operator server), subject to each operation's own switch (runtime loading is off then
    unless enabled explicitly). A key bound to some targets never may.
    """
    return caller.admin or (not keys.has_admins and caller.binding is None)


def require_admin(request: Request, caller: Annotated[Principal, Depends(get_caller)]) -> Principal:
    """An admin caller (see :func:`admin_allowed`).

    Raises:
        HTTPException: 401 without a valid key, 403 for a user key.
    """
    if not admin_allowed(request.app.state.server.keys, caller):
        raise HTTPException(403, "this operation needs an admin key")
    return caller


def require_admin_key(caller: Annotated[Principal, Depends(get_caller)]) -> Principal:
    """A caller holding an admin key, whatever else is configured (no single-operator fallback).

    Raises:
        HTTPException: 401 without a valid key, 403 for any other key.
    """
    if not caller.admin:
        raise HTTPException(403, "this operation needs an admin key")
    return caller


# Handlers declare ``state: State`` and ``caller: Caller`` (FastAPI's Annotated dependency style).
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Principal, Depends(get_caller)]
Admin = Annotated[Principal, Depends(require_admin)]
AdminKey = Annotated[Principal, Depends(require_admin_key)]
