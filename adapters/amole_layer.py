"""AMoLE inside the multi-adapter layer: expert storage, token projections, the routed forward.

FedAMoLE (paper 002, section 4.2; METHODS.md 1.1): every adapted Linear holds a pool of domain
experts (ordinary LoRA adapters named ``expert_<j>``), a shared expert (``expert_shared``) and one
bias-free token projection ``P`` (r x d), the router's only parameter: its shape does not depend on
how many experts a client holds, so it averages across clients. A client's assignment differs per
module; rows of one batch may belong to different clients (serving), so rows are grouped by client
and each group runs :func:`adapters.amole.amole_forward` on its own experts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from adapters.amole import amole_forward
from adapters.config import AdapterError, LoraConfig
from adapters.context import AMoLERouting

if TYPE_CHECKING:
    from adapters.inject import AdaptedModel
    from adapters.layer import MultiLoraLinear

SHARED = "expert_shared"


def expert_name(j: int) -> str:
    """Adapter name of domain expert ``j``."""
    return f"expert_{j}"


def add_amole_experts(
    adapted: AdaptedModel, num_experts: int, config: LoraConfig, seed: int = 0, shared: bool = True
) -> None:
    """Create ``num_experts`` domain experts, the shared expert and a token projection per layer.

    Experts get PEFT's init (A Kaiming-uniform from distinct seeds so they differ, B zero); P gets
    ``nn.Linear``'s default init, as the reference code (METHODS.md 1.1).
    """
    if num_experts < 1:
        raise AdapterError(f"num_experts must be >= 1, got {num_experts}")
    for j in range(num_experts):
        adapted.add_adapter(expert_name(j), config, seed=seed * 100_003 + j)
    if shared:
        adapted.add_adapter(SHARED, config, seed=seed * 100_003 + num_experts)
    gen = torch.Generator().manual_seed(seed * 100_003 + num_experts + 1)
    for layer in adapted.target_layers(config).values():
        P = torch.empty(config.r, layer.in_features, device=layer.base_layer.weight.device)
        nn.init.kaiming_uniform_(P, a=math.sqrt(5), generator=gen)
        layer.token_proj = nn.Parameter(P)


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


def amole_layer_forward(
    layer: MultiLoraLinear, x: torch.Tensor, result: torch.Tensor, routing: AMoLERouting
) -> torch.Tensor:
    """Return ``result`` plus each row's client-specific AMoLE update (equation (11)).

    Args:
        layer: the adapted layer (holds experts, shared expert and ``token_proj``).
        x: (B, T, d) or (B, d) layer input.
        result: the frozen layer's output for ``x``.
        routing: the batch's per-row client assignments.
    """
    if layer.token_proj is None:
        raise AdapterError(f"{layer.layer_name} has no AMoLE token projection; call add_amole_experts first")
    row_group = routing.row_group.to(x.device)
    if row_group.shape[0] != x.shape[0]:
        if row_group.shape[0] == 0 or x.shape[0] % row_group.shape[0]:
            raise AdapterError(f"AMoLE routing has {row_group.shape[0]} rows, the batch has {x.shape[0]}")
        row_group = row_group.repeat_interleave(x.shape[0] // row_group.shape[0])  # beam search
    shared = layer.adapters[SHARED] if routing.shared and SHARED in layer.adapters else None
    out = result
    for g in torch.unique(row_group).tolist():
        experts = routing.groups[g].get(layer.layer_name)
        if not experts:
            raise AdapterError(f"client group {g} has no expert assignment for {layer.layer_name}")
        missing = [j for j in experts if expert_name(j) not in layer.adapters]
        if missing:
            raise AdapterError(f"{layer.layer_name} has no domain experts {missing}")
        adapters = [layer.adapters[expert_name(j)] for j in experts]
        A = torch.stack([a.lora_A for a in adapters])  # (E, r, d)
        B = torch.stack([a.lora_B for a in adapters])  # (E, o, r)
        rows = (row_group == g).nonzero(as_tuple=True)[0]
        whole = rows.numel() == x.shape[0]
        xg, rg = (x, result) if whole else (x.index_select(0, rows), result.index_select(0, rows))
        if routing.observer is not None:
            routing.observer(layer.layer_name, g, xg.detach(), layer.token_proj.detach(), A.detach())
        res = amole_forward(
            xg, rg,
            shared.lora_A if shared is not None else None,
            shared.lora_B if shared is not None else None,
            A, B, layer.token_proj, adapters[0].scaling, routing.top_k,
            dropout_p=adapters[0].config.dropout, training=layer.training,
            routed_dropout=routing.routed_dropout,  # type: ignore[arg-type]
        )
        if torch.is_grad_enabled():
            routing.stats.append((layer.layer_name, res.gates_full, res.topk_idx))
        out = res.out if whole else out.index_copy(0, rows, res.out.to(out.dtype))
    return out


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
