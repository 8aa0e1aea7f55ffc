"""Runtime adapter load/unload with vLLM's endpoints and bodies (behind ``allow_runtime_lora``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from serving.api.dependencies import ServerState, State, require_api_key
from serving.api.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


def _pool(state: ServerState):  # type: ignore[no-untyped-def]
    if not state.settings.allow_runtime_lora or state.pool is None:
        raise HTTPException(404, "runtime adapter loading is disabled on this server")
    return state.pool


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, state: State) -> PlainTextResponse:
    """Load (or with ``load_inplace`` reload, as a new version) a PEFT adapter folder."""
    pool = _pool(state)
    info = await run_in_threadpool(pool.load, body.lora_name, body.lora_path, body.pinned, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{info.name}' added successfully (version {info.version}).")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest,
                              state: State) -> PlainTextResponse:
    """Unload an adapter; requests already using it finish with it."""
    pool = _pool(state)
    await run_in_threadpool(pool.unload, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
