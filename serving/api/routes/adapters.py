"""Runtime adapter load/unload with vLLM's endpoints and bodies: admin keys only, and only when enabled.

Enabled by ``allow_runtime_lora`` (default: exactly when an admin key is configured, so an open server
never lets anyone load adapters; vLLM's default is off too). The rules on names, roots and pins are
:mod:`serving.adapter_admin`'s.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from serving import adapter_admin
from serving.api.dependencies import Admin, ServerState, State
from serving.api.openapi import errors, text
from serving.openai.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from serving.stack import ServingStack

router = APIRouter()


def _stack(state: ServerState) -> ServingStack:
    if not state.runtime_lora or state.stack is None:
        raise HTTPException(404, "runtime adapter loading is disabled on this server (enable it with "
                                 "--runtime-lora or FEDMOSAIC_SERVE_ALLOW_RUNTIME_LORA=true)")
    return state.stack


@router.post("/v1/load_lora_adapter", response_model=None,
             responses={**text(), **errors(400, 401, 403, 404, 413, 503)})
async def load_lora_adapter(caller: Admin, body: LoadLoraAdapterRequest, state: State) -> PlainTextResponse:
    """Load (or with ``load_inplace`` reload, as a new version) a PEFT adapter folder under the adapter root."""
    stack = _stack(state)
    info = await run_in_threadpool(adapter_admin.load, stack, body.lora_name, body.lora_path, body.pinned,
                                   body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{info.name}' added successfully (version {info.version}).")


@router.post("/v1/unload_lora_adapter", response_model=None,
             responses={**text(), **errors(400, 401, 403, 404, 409, 413, 503)})
async def unload_lora_adapter(caller: Admin, body: UnloadLoraAdapterRequest,
                              state: State) -> PlainTextResponse:
    """Unload an adapter (a pinned one only with ``force`` and an admin key); requests using it finish with it."""
    stack = _stack(state)
    # on a server with keys, tenants all need `global` and the pinned adapters: only an admin key removes them
    if not caller.admin and not state.keys.open and adapter_admin.needs_admin_key(stack, body.lora_name):
        raise HTTPException(403, "unloading global or a pinned adapter needs an admin key")
    await run_in_threadpool(adapter_admin.unload, stack, body.lora_name, body.force)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
