"""AMoLE's per-token routing: the batch's client assignments, expert sources and expert-usage recorder.

FedAMoLE (paper 002, section 4.2; METHODS.md 1.1) routes every token of a client over the domain
experts assigned to that client in each module. :class:`AMoLERouting` is the batch's routing: it is
the :class:`~adapters.context.TokenRouting` hook an :class:`~adapters.context.AdapterContext` hands to
every adapted layer (``context.route_tokens(routing)``), which calls :meth:`AMoLERouting.forward`;
the layer itself knows nothing of AMoLE. :class:`AMoLEExperts` says where a group's experts live when
several AMoLE models share the layers; :class:`ExpertRecorder` tallies the experts tokens chose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from adapters.amole_layer import amole_layer_forward, check_router
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
        recorder: optional :class:`ExpertRecorder` receiving every token's top-k expert ids (off by
            default; the layers skip it when None).
        router: ``amole`` (the shape-invariant gate, the layer's ``token_proj`` is P (r, d)) or ``vanilla``
            (FedAMoLE-A: ``token_proj`` is the linear router W (N_e, d) over every expert; paper 002 s5.5).
    """

    groups: tuple[Mapping[str, tuple[int, ...]], ...]
    row_group: torch.Tensor
    top_k: int = 2
    shared: bool = True
    routed_dropout: str = "per_expert"
    stats: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list, compare=False)
    observer: Callable[[str, int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    experts: tuple[AMoLEExperts, ...] = ()
    recorder: ExpertRecorder | None = field(default=None, compare=False)
    router: str = "amole"

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
    router: str | None = None

    def __post_init__(self) -> None:
        if self.router is not None:
            check_router(self.router)
        if self.top_k is not None and self.top_k < 1:
            raise AdapterError(f"top_k must be >= 1, got {self.top_k}")


class ExpertRecorder:
    """Off-by-default hook: the top-k domain-expert ids every routed token chose, by layer and row.

    Set it on :attr:`AMoLERouting.recorder`; each AMoLE layer then hands it, per client group, the
    batch rows it routed, their tokens' top-k selections as positions in the group's assignment,
    and that assignment (position -> expert id ``j`` of ``expert_<j>``). Recording only keeps
    references; :meth:`counts` tallies every record in a fixed number of tensor operations, however
    many layers and groups the forward had. Padding positions are recorded like any token (the
    serving engine prefills without padding).
    """

    def __init__(self) -> None:
        # (layer path, rows (n,), choices (n*T, k) positions, expert ids of the positions)
        self.records: list[tuple[str, torch.Tensor, torch.Tensor, tuple[int, ...]]] = []

    def record(self, path: str, rows: torch.Tensor, choices: torch.Tensor, experts: Sequence[int]) -> None:
        """Keep the selections of batch ``rows`` (n,) in layer ``path``.

        Args:
            path: the layer's module path.
            rows: (n,) batch rows of the group.
            choices: (n*T, k) top-k positions into ``experts``, tokens of a row contiguous.
            experts: the group's assigned expert ids in that layer.
        """
        self.records.append((path, rows, choices, tuple(experts)))

    def choices(self, path: str, row: int) -> torch.Tensor:
        """Return the (T, k) expert ids row ``row`` chose in layer ``path`` (its latest record)."""
        for p, rows, chosen, experts in reversed(self.records):
            hit = (rows == row).nonzero(as_tuple=True)[0]
            if p == path and hit.numel():
                per_row = chosen.view(rows.numel(), -1, chosen.shape[-1])[int(hit[0])].cpu()  # (T, k)
                return torch.tensor(experts, dtype=torch.long, device="cpu")[per_row]
        raise AdapterError(f"nothing recorded for row {row} in {path}")

    def counts(self, paths: Sequence[str], num_experts: int, rows: int, last_token: bool = False) -> torch.Tensor:
        """Tally the recorded selections into ``(rows, len(paths), num_experts)`` counts.

        Args:
            paths: layer paths, in the order of the second axis; recorded layers not listed are an error.
            num_experts: size of the last axis (expert ids must be below it).
            rows: batch rows of the first axis.
            last_token: count only each row's last position (the token a decode step predicts from).

        Returns:
            A long tensor; every token adds its k selections, so a layer's row sums to k x tokens.
        """
        index = {p: i for i, p in enumerate(paths)}
        if not self.records:
            return torch.zeros(rows, len(paths), num_experts, dtype=torch.long, device="cpu")
        unknown = sorted({r[0] for r in self.records} - set(index))
        if unknown:
            raise AdapterError(f"recorded layers {unknown[:3]} are not among the {len(paths)} paths asked for")
        picks, row_parts, row_repeats, sizes, layers, table = [], [], [], [], [], []
        width = max(len(r[3]) for r in self.records)
        for path, row_ids, chosen, experts in self.records:
            n, k = row_ids.numel(), chosen.shape[-1]
            if last_token:
                chosen = chosen.view(n, -1, k)[:, -1]  # (n, k)
            picks.append(chosen.reshape(-1))
            row_parts.append(row_ids)
            row_repeats += [chosen.numel() // max(n, 1)] * n
            sizes.append(chosen.numel())
            layers.append(index[path])
            table.append(list(experts) + [0] * (width - len(experts)))
        pick = torch.cat(picks).cpu()  # (S,) positions, all records
        # host-side tally (the records were moved to the CPU above): the counts are a report, not a tensor op
        row = torch.cat(row_parts).cpu().repeat_interleave(torch.tensor(row_repeats, device="cpu"))  # (S,)
        record = torch.arange(len(sizes), device="cpu").repeat_interleave(torch.tensor(sizes, device="cpu"))  # (S,)
        expert = torch.tensor(table, dtype=torch.long, device="cpu")[record, pick]  # (S,) expert ids
        layer = torch.tensor(layers, dtype=torch.long, device="cpu")[record]  # (S,)
        if int(expert.max()) >= num_experts:
            raise AdapterError(f"expert id {int(expert.max())} does not fit num_experts={num_experts}")
        flat = (row * len(paths) + layer) * num_experts + expert
        return torch.bincount(flat, minlength=rows * len(paths) * num_experts).view(rows, len(paths), num_experts)
