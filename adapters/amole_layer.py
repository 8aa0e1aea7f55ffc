"""AMoLE's storage inside the multi-adapter layer: experts, token projections, their state and parameters.

FedAMoLE (paper 002, section 4.2; docs/methods.md 1.1): every adapted Linear holds a pool of domain
experts (ordinary LoRA adapters named ``expert_<j>``), a shared expert (``expert_shared``) and one
bias-free token projection ``P`` (r x d), the router's only parameter: its shape does not depend on
how many experts a client holds, so it averages across clients. This module creates them, names them,
saves and loads the projections and lists the trainable tensors; routing tokens over them is
:mod:`adapters.amole_routing`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from adapters.amole import Router
from adapters.config import AdapterError, LoraConfig

if TYPE_CHECKING:
    from adapters.inject import AdaptedModel

SHARED = "expert_shared"
ROUTERS: tuple[str, ...] = ("amole", "vanilla")


def check_router(router: str) -> Router:
    """Return ``router`` if it is ``amole`` or ``vanilla`` (FedAMoLE-A's MoLE router), else raise AdapterError."""
    if router not in ROUTERS:
        raise AdapterError(f"AMoLE router must be one of {ROUTERS}, got {router!r}")
    return cast(Router, router)  # one of ROUTERS, the values of Router


def expert_name(j: int) -> str:
    """Adapter name of domain expert ``j``."""
    return f"expert_{j}"


def add_amole_experts(
    adapted: AdaptedModel, num_experts: int, config: LoraConfig, seed: int = 0, shared: bool = True,
    router: Router = "amole",
) -> None:
    """Create ``num_experts`` domain experts, the shared expert and a router per layer.

    Experts get PEFT's init (A Kaiming-uniform from distinct seeds so they differ, B zero); the router gets
    ``nn.Linear``'s default init, as the reference code (docs/methods.md 1.1). Its shape depends on ``router``:
    AMoLE's token projection P is (r, d); FedAMoLE-A's vanilla MoLE router W is (num_experts, d), one row
    per assignable expert (paper 002 s5.5), stored in the same ``token_proj`` slot so that it is sent,
    averaged and saved exactly like P.
    """
    rows = num_experts if check_router(router) == "vanilla" else config.r
    if num_experts < 1:
        raise AdapterError(f"num_experts must be >= 1, got {num_experts}")
    for j in range(num_experts):
        adapted.add_adapter(expert_name(j), config, seed=seed * 100_003 + j)
    if shared:
        adapted.add_adapter(SHARED, config, seed=seed * 100_003 + num_experts)
    gen = torch.Generator().manual_seed(seed * 100_003 + num_experts + 1)
    for layer in adapted.target_layers(config).values():
        # drawn on the CPU generator's device, then copied: the same projections on every device
        P = torch.empty(rows, layer.in_features, device=gen.device)
        nn.init.kaiming_uniform_(P, a=math.sqrt(5), generator=gen)
        layer.token_proj = nn.Parameter(P.to(layer.base_layer.weight.device))


def token_proj_state(adapted: AdaptedModel) -> dict[str, torch.Tensor]:
    """Return ``{"<path>.token_proj": P}`` for every layer that has one (detached)."""
    return {
        f"{path}.token_proj": layer.token_proj.detach()
        for path, layer in adapted.layers.items()
        if layer.token_proj is not None
    }


def load_token_proj_state(adapted: AdaptedModel, state: dict[str, torch.Tensor]) -> None:
    """Copy token projections back, checking keys and shapes."""
    expected = token_proj_state(adapted)
    if set(state) != set(expected):
        diff = sorted(set(state) ^ set(expected))[:3]
        raise AdapterError(f"token projections: expected {len(expected)} keys, got {len(state)} ({diff})")
    for key, value in state.items():
        layer = adapted.layers[key[: -len(".token_proj")]]
        assert layer.token_proj is not None
        if value.shape != layer.token_proj.shape:
            raise AdapterError(f"{key}: expected {tuple(layer.token_proj.shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            layer.token_proj.copy_(value)


def amole_parameters(adapted: AdaptedModel, assignment: dict[str, tuple[int, ...]] | None = None) -> list[nn.Parameter]:
    """Trainable AMoLE tensors: token projections, the shared expert, and the assigned experts
    (all experts when ``assignment`` is None)."""
    params: list[nn.Parameter] = []
    for path, layer in adapted.layers.items():
        if layer.token_proj is None:
            continue
        params.append(layer.token_proj)
        names = [SHARED] if SHARED in layer.adapters else []
        ids = assignment.get(path, ()) if assignment is not None else None
        names += [n for n in layer.adapters if n.startswith("expert_") and n != SHARED
                  and (ids is None or int(n.split("_")[1]) in ids)]
        for n in names:
            params.extend([layer.adapters[n].lora_A, layer.adapters[n].lora_B])
    return params
