"""GET /v1/models (and /v1/models/{id}): what the caller's key may use among the base model, its aliases,
adapters and clients."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter

from serving.api.dependencies import Caller, ServerState, State
from serving.api.openapi import errors
from serving.errors import ModelNotFound
from serving.openai.schemas import ModelCard, ModelList
from serving.pool import AdapterInfo

router = APIRouter()


def shown_path(info: AdapterInfo, root: Path | None) -> str:
    """An adapter's folder as ``/v1/models`` shows it: relative to the adapter root, never absolute."""
    if root is not None and info.path.is_relative_to(root):
        return info.path.relative_to(root).as_posix() or "."
    return info.path.name


def card(state: ServerState, name: str, infos: dict[str, AdapterInfo]) -> ModelCard:
    """The ``/v1/models`` card of the served name ``name``."""
    assert state.resolver is not None
    base = state.base_name
    pool = state.pool
    info = infos.get(name)
    if name == base:
        return ModelCard(id=base, created=state.created, root=base, fedmosaic={"kind": "base"})
    if info is not None:
        extra = {"kind": "adapter", "version": info.version, "pinned": info.pinned, "loaded": info.loaded}
        return ModelCard(id=name, created=state.created, root=shown_path(info, pool.root if pool else None),
                         parent=base, fedmosaic=extra)
    described = state.resolver.describe(name)
    if described.get("alias_of") is not None:  # another name of the base model (--served-model-name)
        return ModelCard(id=name, created=state.created, root=base, fedmosaic=described)
    return ModelCard(id=name, created=state.created, root=base, parent=base, fedmosaic=described)


def _infos(state: ServerState) -> dict[str, AdapterInfo]:
    return {i.name: i for i in state.pool.info()} if state.pool is not None else {}


@router.get("/v1/models", responses=errors(401, 503))
def list_models(caller: Caller, state: State) -> ModelList:
    """List the names the ``model`` field accepts for this key (vLLM style: adapters have the base as parent).

    A key bound to some targets sees only those; ``root`` of an adapter is its folder relative to the
    adapter root (no absolute path). The base model's aliases (``--served-model-name``) follow it.
    """
    assert state.resolver is not None
    infos = _infos(state)
    return ModelList(data=[card(state, name, infos) for name in state.resolver.models()
                           if caller.allows(name, state.base_name)])


@router.get("/v1/models/{model:path}", responses=errors(401, 404, 503))
def retrieve_model(model: str, caller: Caller, state: State) -> ModelCard:
    """One card of ``/v1/models`` (OpenAI's retrieve); 404 for a name not served or outside the key's binding."""
    assert state.resolver is not None
    if not caller.allows(model, state.base_name) or not state.resolver.serves(model):
        raise ModelNotFound(f"the model {model!r} does not exist (GET /v1/models lists what this key may use)")
    return card(state, model, _infos(state))
