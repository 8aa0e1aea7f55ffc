"""AMoLE inside the multi-adapter layer: expert storage, token projections, the routed forward.

FedAMoLE (paper 002, section 4.2; METHODS.md 1.1): every adapted Linear holds a pool of domain
experts (ordinary LoRA adapters named ``expert_<j>``), a shared expert (``expert_shared``) and one
bias-free token projection ``P`` (r x d), the router's only parameter: its shape does not depend on
how many experts a client holds, so it averages across clients. A client's assignment differs per
module; rows of one batch may belong to different clients (serving), so rows are grouped by client:
at inference the clients of one source run together over the union of their experts, otherwise each
group runs :func:`adapters.amole.amole_forward` on its own experts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from adapters.amole import amole_forward
from adapters.amole_union import GroupSetup, union_forward, union_ids
from adapters.config import AdapterError, LoraConfig

if TYPE_CHECKING:
    from adapters.amole_routing import AMoLEExperts, AMoLERouting
    from adapters.inject import AdaptedModel
    from adapters.layer import MultiLoraLinear

SHARED = "expert_shared"
ROUTERS: tuple[str, ...] = ("amole", "vanilla")


def check_router(router: str) -> str:
    """Return ``router`` if it is ``amole`` or ``vanilla`` (FedAMoLE-A's MoLE router), else raise AdapterError."""
    if router not in ROUTERS:
        raise AdapterError(f"AMoLE router must be one of {ROUTERS}, got {router!r}")
    return router


def expert_name(j: int) -> str:
    """Adapter name of domain expert ``j``."""
    return f"expert_{j}"


def add_amole_experts(
    adapted: AdaptedModel, num_experts: int, config: LoraConfig, seed: int = 0, shared: bool = True,
    router: str = "amole",
) -> None:
    """Create ``num_experts`` domain experts, the shared expert and a router per layer.

    Experts get PEFT's init (A Kaiming-uniform from distinct seeds so they differ, B zero); the router gets
    ``nn.Linear``'s default init, as the reference code (METHODS.md 1.1). Its shape depends on ``router``:
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


def amole_layer_forward(
    layer: MultiLoraLinear, x: torch.Tensor, result: torch.Tensor, routing: AMoLERouting
) -> torch.Tensor:
    """Return ``result`` plus each row's client-specific AMoLE update (equation (11)).

    At inference, clients of one expert source run together over the union of their experts
    (:mod:`adapters.amole_union`); in training, or for a client alone, each group runs
    :func:`adapters.amole.amole_forward` on its own experts.

    Args:
        layer: the adapted layer (holds experts, shared expert and ``token_proj``).
        x: (B, T, d) or (B, d) layer input.
        result: the frozen layer's output for ``x``.
        routing: the batch's per-row client assignments (rows of group -1 keep ``result``).
    """
    row_group = routing.row_group  # (B,) on the CPU: grouping rows needs no device round trip
    if row_group.shape[0] != x.shape[0]:
        if row_group.shape[0] == 0 or x.shape[0] % row_group.shape[0]:
            raise AdapterError(f"AMoLE routing has {row_group.shape[0]} rows, the batch has {x.shape[0]}")
        row_group = row_group.repeat_interleave(x.shape[0] // row_group.shape[0])  # beam search
    setups = [s for g in torch.unique(row_group).tolist() if g >= 0 and (s := _setup(layer, routing, g)) is not None]
    batched: dict[tuple[str, int, int, bool], list[GroupSetup]] = {}
    if not torch.is_grad_enabled() and not layer.training and routing.observer is None:
        for s in setups:
            batched.setdefault(s.batch_key, []).append(s)
    out = result
    for s in setups:
        together = batched.get(s.batch_key, [])
        if len(together) > 1:
            if s is together[0]:
                names = [s.prefix + expert_name(j) for j in union_ids(together)]
                shared = s.prefix + SHARED if s.shared and s.prefix + SHARED in layer.adapters else None
                out = union_forward(layer, x, out, row_group, together, names, shared, routing.recorder)
            continue
        out = _group_forward(layer, x, result, out, row_group, s, routing)
    return out


def _setup(layer: MultiLoraLinear, routing: AMoLERouting, g: int) -> GroupSetup | None:
    """Group ``g``'s routing in ``layer``, or None when its AMoLE model does not adapt the layer."""
    source = routing.experts[g] if routing.experts else None
    experts = routing.groups[g].get(layer.layer_name)
    if not experts:
        if source is not None and layer.layer_name not in routing.groups[g]:
            return None  # that AMoLE model does not adapt this layer (a server may inject more layers)
        raise AdapterError(f"client group {g} has no expert assignment for {layer.layer_name}")
    prefix = source.prefix if source is not None else ""
    missing = [j for j in experts if prefix + expert_name(j) not in layer.adapters]
    if missing:
        raise AdapterError(f"{layer.layer_name} has no domain experts {missing}")
    top_k = source.top_k if source is not None and source.top_k is not None else routing.top_k
    use_shared = source.shared if source is not None and source.shared is not None else routing.shared
    router = source.router if source is not None and source.router is not None else routing.router
    return GroupSetup(g, prefix, tuple(experts), _token_proj(layer, source), top_k, bool(use_shared), router)


def _group_forward(layer: MultiLoraLinear, x: torch.Tensor, result: torch.Tensor, out: torch.Tensor,
                   row_group: torch.Tensor, s: GroupSetup, routing: AMoLERouting) -> torch.Tensor:
    """One client group on its own experts (training, or a client alone in its batch)."""
    prefix, experts, P = s.prefix, s.experts, s.P
    shared = layer.adapters[prefix + SHARED] if s.shared and prefix + SHARED in layer.adapters else None
    names = tuple(prefix + expert_name(j) for j in experts)
    adapters = [layer.adapters[n] for n in names]
    if torch.is_grad_enabled():
        A = torch.stack([a.lora_A for a in adapters])  # (E, r, d)
        B = torch.stack([a.lora_B for a in adapters])  # (E, o, r)
    else:  # decoding: the same stacks every step, cached by the layer
        A, B = layer.frozen_stacks(names, x.dtype)
    sh_A, sh_B = (shared.lora_A, shared.lora_B) if shared is not None else (None, None)
    # fp32 adapters in a bf16 model compute in the model's dtype; each cast on its own, since the cached
    # stacks already come in x's dtype while P and the shared expert do not (a no-op when dtypes agree)
    A, B, P = A.to(x.dtype), B.to(x.dtype), P.to(x.dtype)
    if sh_A is not None and sh_B is not None:
        sh_A, sh_B = sh_A.to(x.dtype), sh_B.to(x.dtype)
    rows = (row_group == s.group).nonzero(as_tuple=True)[0].to(x.device)
    whole = rows.numel() == x.shape[0]
    xg, rg = (x, result) if whole else (x.index_select(0, rows), result.index_select(0, rows))
    if routing.observer is not None:  # a vanilla router's full W (N_e, d): its mean logits are FedAMoLE-A's relevance
        routing.observer(layer.layer_name, s.group, xg.detach(), P.detach(), A.detach())
    gate = P.index_select(0, torch.tensor(experts, device=P.device)) if s.router == "vanilla" else P  # (E, d)
    res = amole_forward(
        xg, rg, sh_A, sh_B, A, B, gate, adapters[0].scaling, s.top_k,
        dropout_p=adapters[0].config.dropout, training=layer.training,
        routed_dropout=routing.routed_dropout,  # type: ignore[arg-type]
        router=s.router,  # type: ignore[arg-type]
    )
    if torch.is_grad_enabled():
        routing.stats.append((layer.layer_name, res.gates_full, res.topk_idx))
    if routing.recorder is not None:
        routing.recorder.record(layer.layer_name, rows, res.topk_idx, experts)  # (N, k) positions in experts
    return res.out if whole else out.index_copy(0, rows, res.out.to(out.dtype))


def _token_proj(layer: MultiLoraLinear, source: AMoLEExperts | None) -> torch.Tensor:
    """The group's router parameter (token projection or vanilla router): its source's for this layer, else the
    layer's own."""
    if source is not None and source.token_proj is not None:
        P = source.token_proj.get(layer.layer_name)
        if P is None:
            raise AdapterError(f"no AMoLE token projection for {layer.layer_name} under {source.prefix!r}")
        return P
    if layer.token_proj is None:
        raise AdapterError(f"{layer.layer_name} has no AMoLE token projection; call add_amole_experts first")
    return layer.token_proj


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
