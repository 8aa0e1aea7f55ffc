"""AMoLE's per-token routing: the batch's client assignments, expert sources and the routed forward.

FedAMoLE (paper 002, section 4.2; docs/methods.md 1.1) routes every token of a client over the domain
experts assigned to that client in each module. :class:`AMoLERouting` is the batch's routing: it is
the :class:`~adapters.context.TokenRouting` hook an :class:`~adapters.context.AdapterContext` hands to
every adapted layer (``context.route_tokens(routing)``), which calls :meth:`AMoLERouting.forward`;
the layer itself knows nothing of AMoLE. :class:`AMoLEExperts` says where a group's experts live when
several AMoLE models share the layers. :func:`amole_layer_forward` is that hook's work in one layer:
rows of one batch may belong to different clients (serving), so rows are grouped by client; at
inference the clients of one source run together over the union of their experts
(:mod:`adapters.amole_union`), otherwise each group runs :func:`adapters.amole.amole_forward` on its
own experts (stored by :mod:`adapters.amole_layer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from adapters.amole import RoutedDropout, Router, amole_forward
from adapters.amole_layer import SHARED, check_router, expert_name
from adapters.amole_union import ExpertRecorder, GroupSetup, union_forward, union_ids
from adapters.config import AdapterError

if TYPE_CHECKING:
    from adapters.layer import MultiLoraLinear


@dataclass(frozen=True)
class AMoLERouting:
    """Per-token AMoLE routing for the current batch (FedAMoLE, paper 002 section 4.2).

    Rows are grouped by client: ``groups[row_group[b]]`` maps each adapted layer's path to the
    domain-expert ids that row's client holds in that layer (a client's assignment differs per
    module). Layers compute the gate themselves from their token projection, so the weights are
    per token and never materialised here.

    Attributes:
        groups: one mapping per distinct client, layer path -> expert ids (sizes may differ).
        row_group: (B,) long tensor, the group of every batch row. Host-side bookkeeping: it is kept on
            the CPU whatever device it comes from, so the layers group rows without waiting on a GPU
            (they move each group's row indices to the activations' device).
        top_k: experts per token (clipped to the number a client holds).
        shared: add the shared expert at weight 1 (False: the paper's no-shared ablation).
        routed_dropout: ``per_expert`` (reference) or ``per_token`` (faster; see adapters.amole).
        stats: filled by the layers during the forward with (layer path, full gates (N, E),
            top-k ids (N, k)) per group, for the load-balance loss; cleared by the caller.
        observer: optional callback ``(layer path, group, h (n, T, d), P (r, d), A (E, r, d))``
            called by every layer with its input, for the RSEA embeddings (paper 002 eq. 17, 19).
        experts: optional, one per group: where that group's experts live when several AMoLE
            models share the layers (a server holding two versions of a run). Empty: every group
            uses the layer's ``expert_<j>``, ``expert_shared`` and ``token_proj``.
        recorder: optional :class:`~adapters.amole_union.ExpertRecorder` receiving every token's top-k
            expert ids (off by default; the layers skip it when None).
        router: ``amole`` (the shape-invariant gate, the layer's ``token_proj`` is P (r, d)) or ``vanilla``
            (FedAMoLE-A: ``token_proj`` is the linear router W (N_e, d) over every expert; paper 002 s5.5).
    """

    groups: tuple[Mapping[str, Sequence[int]], ...]
    row_group: torch.Tensor
    top_k: int = 2
    shared: bool = True
    routed_dropout: RoutedDropout = "per_expert"
    stats: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list, compare=False)
    observer: Callable[[str, int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    experts: tuple[AMoLEExperts, ...] = ()
    recorder: ExpertRecorder | None = field(default=None, compare=False)
    router: Router = "amole"

    def __post_init__(self) -> None:
        check_router(self.router)
        if not self.groups:
            raise AdapterError("AMoLE routing needs at least one client assignment")
        if isinstance(self.row_group, torch.Tensor) and self.row_group.device.type != "cpu":
            object.__setattr__(self, "row_group", self.row_group.cpu())  # one copy per forward, not per layer
        if self.row_group.dim() != 1 or self.row_group.dtype not in (torch.int32, torch.int64):
            raise AdapterError(f"row_group must be a (B,) integer tensor, got {tuple(self.row_group.shape)}")
        if self.row_group.numel() and (int(self.row_group.min()) < -1 or int(self.row_group.max()) >= len(self.groups)):
            raise AdapterError(f"row_group values must index the {len(self.groups)} assignment groups "
                               "(or be -1 for rows without AMoLE)")
        if self.top_k < 1:
            raise AdapterError(f"top_k must be >= 1, got {self.top_k}")
        if self.experts and len(self.experts) != len(self.groups):
            raise AdapterError(f"experts must give one source per group: {len(self.experts)} for "
                               f"{len(self.groups)} groups")

    @property
    def rows(self) -> int:
        """Batch rows the routing describes."""
        return int(self.row_group.shape[0])

    def forward(self, layer: MultiLoraLinear, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """The :class:`~adapters.context.TokenRouting` hook: ``result`` plus each row's AMoLE update."""
        return amole_layer_forward(layer, x, result, self)


@dataclass(frozen=True)
class AMoLEExperts:
    """Where one routing group's experts live, when several AMoLE models share the adapted layers.

    A server keeps every loaded version of an AMoLE run in the same layers under its own adapter
    name prefix, so requests started on an old version finish on it while new ones use the new one.

    Attributes:
        prefix: adapter names are ``<prefix>expert_<j>`` and ``<prefix>expert_shared``.
        token_proj: layer path -> that layer's token projection P (r, d); None: ``layer.token_proj``.
        top_k: experts per token for this group; None: the routing's ``top_k``.
        shared: add this group's shared expert; None: the routing's ``shared``.
        router: this group's gate, ``amole`` or ``vanilla`` (``token_proj`` then holds W (N_e, d));
            None: the routing's ``router``.
    """

    prefix: str = ""
    token_proj: Mapping[str, torch.Tensor] | None = field(default=None, compare=False)
    top_k: int | None = None
    shared: bool | None = None
    router: Router | None = None

    def __post_init__(self) -> None:
        if self.router is not None:
            check_router(self.router)
        if self.top_k is not None and self.top_k < 1:
            raise AdapterError(f"top_k must be >= 1, got {self.top_k}")


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
    batched: dict[tuple[str, int, int, bool, str], list[GroupSetup]] = {}
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
    # checked by AMoLEExperts' and AMoLERouting's __post_init__ (check_router)
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
    sh_A: torch.Tensor | None = shared.lora_A if shared is not None else None
    sh_B: torch.Tensor | None = shared.lora_B if shared is not None else None
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
        routed_dropout=routing.routed_dropout, router=s.router,
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
