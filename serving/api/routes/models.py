"""GET /v1/models: the base model, every loaded adapter, and every FedDPA or AMoLE client."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from serving.api.dependencies import State, require_api_key
from serving.api.protocol import ModelCard, ModelList

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
def list_models(state: State) -> ModelList:
    """List every name the ``model`` field accepts (vLLM style: adapters have the base as parent)."""
    assert state.resolver is not None
    base = state.base_name
    cards = [ModelCard(id=base, created=state.created, root=base, fedmosaic={"kind": "base"})]
    infos = {i.name: i for i in state.pool.info()} if state.pool is not None else {}
    for name in state.resolver.models()[1:]:
        info = infos.get(name)
        if info is not None:
            extra = {"kind": "adapter", "version": info.version, "pinned": info.pinned, "loaded": info.loaded}
            cards.append(ModelCard(id=name, created=state.created, root=str(info.path), parent=base, fedmosaic=extra))
        else:  # a FedDPA or AMoLE client
            cards.append(ModelCard(id=name, created=state.created, root=base, parent=base,
                                   fedmosaic=state.resolver.describe(name)))
    return ModelList(data=cards)
