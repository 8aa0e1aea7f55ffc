"""GET /v1/models: what the caller's key may use among the base model, adapters and clients."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter

from serving.api.dependencies import Caller, State
from serving.api.openapi import errors
from serving.openai.schemas import ModelCard, ModelList
from serving.pool import AdapterInfo

router = APIRouter()


def shown_path(info: AdapterInfo, root: Path | None) -> str:
    """An adapter's folder as ``/v1/models`` shows it: relative to the adapter root, never absolute."""
    if root is not None and info.path.is_relative_to(root):
        return info.path.relative_to(root).as_posix() or "."
    return info.path.name


@router.get("/v1/models", responses=errors(401, 503))
def list_models(caller: Caller, state: State) -> ModelList:
    """List the names the ``model`` field accepts for this key (vLLM style: adapters have the base as parent).

    A key bound to some targets sees only those; ``root`` of an adapter is its folder relative to the
    adapter root (no absolute path).
    """
    assert state.resolver is not None
    base = state.base_name
    pool = state.pool
    infos = {i.name: i for i in pool.info()} if pool is not None else {}
    root = pool.root if pool is not None else None
    cards = []
    for name in state.resolver.models():
        if not caller.allows(name, base):
            continue
        info = infos.get(name)
        if name == base:
            cards.append(ModelCard(id=base, created=state.created, root=base, fedmosaic={"kind": "base"}))
        elif info is not None:
            extra = {"kind": "adapter", "version": info.version, "pinned": info.pinned, "loaded": info.loaded}
            cards.append(ModelCard(id=name, created=state.created, root=shown_path(info, root), parent=base,
                                   fedmosaic=extra))
        else:  # a FedDPA or AMoLE client
            cards.append(ModelCard(id=name, created=state.created, root=base, parent=base,
                                   fedmosaic=state.resolver.describe(name)))
    return ModelList(data=cards)
