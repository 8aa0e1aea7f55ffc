"""Several AMoLE clients in one inference batch, one pass over the union of their experts; the usage recorder.

Serving puts rows of different FedAMoLE clients in the same decode step (paper 002, section 4.2;
docs/methods.md 1.1). Each client's gate is a softmax over *its* assigned experts in the module, then
top-k and renormalisation. Running that once per client in every layer costs one Python round of
small kernels per (client, layer). Here the clients that share an expert source (one loaded run
version), the shared-expert setting and the effective k = min(top_k, E_c) run together:

- every token is projected onto the union U of those clients' experts, ``A_j h`` for j in U (N, U, r);
- the gate scores ``A_j h . P h / sqrt(r)`` (FedAMoLE-A's vanilla router: ``W_j . h``) of experts
  outside the token's own client's assignment are set to -inf before the softmax, so the softmax, top-k
  and renormalised weights are exactly those over the client's own experts;
- the routed sum is one dense (N, U*r) x (U*r, o) product with the unselected weights at zero.

Only for inference (no autograd, no dropout, no RSEA observer): training runs one client at a time.

:class:`ExpertRecorder` is the off-by-default tally of the experts tokens chose, filled by this union pass
and by the one-client forward of :mod:`adapters.amole_routing`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from adapters.amole import Router, amole_delta_dense
from adapters.config import AdapterError

if TYPE_CHECKING:
    from adapters.layer import MultiLoraLinear


@dataclass(frozen=True)
class GroupSetup:
    """One client group's routing in one layer.

    Attributes:
        group: the group index in ``AMoLERouting.groups``.
        prefix: adapter-name prefix of its expert source ("" for the layer's own experts).
        experts: its assigned domain-expert ids in this layer.
        P: (r, d) its token projection, or (N_e, d) its vanilla router (``router="vanilla"``).
        top_k: experts per token before clipping to ``len(experts)``.
        shared: whether the shared expert adds at weight 1.
        router: ``amole`` or ``vanilla`` (FedAMoLE-A: the gate scores are ``W_j . h``).
    """

    group: int
    prefix: str
    experts: tuple[int, ...]
    P: torch.Tensor
    top_k: int
    shared: bool
    router: Router = "amole"

    @property
    def batch_key(self) -> tuple[str, int, int, bool, str]:
        """Groups with equal keys can share one union pass (same source, projection, k, shared flag, gate)."""
        return (self.prefix, id(self.P), min(self.top_k, len(self.experts)), self.shared, self.router)


def union_forward(
    layer: MultiLoraLinear, x: torch.Tensor, out: torch.Tensor, row_group: torch.Tensor,
    setups: Sequence[GroupSetup], expert_names: Sequence[str], shared_name: str | None,
    recorder: ExpertRecorder | None,
) -> torch.Tensor:
    """Add the routed AMoLE update of every row whose group is in ``setups`` (all with one ``batch_key``).

    Args:
        layer: the adapted layer holding the experts.
        x: (B, T, d) or (B, d) layer input.
        out: the layer output so far (rows of these groups still hold the frozen output).
        row_group: (B,) group of every row (on the CPU).
        setups: the groups to run, at least one, all with the same ``batch_key``.
        expert_names: adapter name of each id in the union, in the order of ``union_ids(setups)``.
        shared_name: the shared expert's adapter name, or None.
        recorder: receives every token's top-k expert ids, or None.

    Returns:
        ``out`` with those rows replaced by frozen output + shared + routed experts.
    """
    union = union_ids(setups)
    pos = {j: i for i, j in enumerate(union)}
    first = setups[0]
    k = min(first.top_k, len(first.experts))
    # host-side bookkeeping (the routing's row groups are on the CPU); the per-token parts move below
    lookup = torch.full((int(row_group.max()) + 1,), -1, dtype=torch.long, device="cpu")  # group -> setup index
    allowed = torch.zeros(len(setups), len(union), dtype=torch.bool, device="cpu")  # (S, U)
    for i, s in enumerate(setups):
        lookup[s.group] = i
        allowed[i, [pos[j] for j in s.experts]] = True
    host = row_group.cpu()  # the routing keeps it there: no copy
    part = lookup[host.clamp(min=0)].masked_fill(host < 0, -1)  # (B,)
    host_rows = (part >= 0).nonzero(as_tuple=True)[0]
    rows = host_rows.to(x.device)
    whole = rows.numel() == x.shape[0]
    xg, base = (x, out) if whole else (x.index_select(0, rows), out.index_select(0, rows))
    d = x.shape[-1]
    hf = xg.reshape(-1, d)  # (N, d)
    per_row = hf.shape[0] // max(rows.numel(), 1)
    token_part = part[host_rows].repeat_interleave(per_row).to(x.device)  # (N,)
    A, B = layer.frozen_stacks(tuple(expert_names), x.dtype)  # (U, r, d), (U, o, r): cached across steps
    scaling = layer.adapters[expert_names[0]].scaling
    U, r, _ = A.shape
    expert_emb = F.linear(hf, A.reshape(U * r, d)).view(-1, U, r)  # (N, U, r)
    if first.router == "vanilla":  # FedAMoLE-A: the router rows of the union's experts score every token
        rows_of_union = torch.tensor(union, device=first.P.device)
        scores = F.linear(hf, first.P.index_select(0, rows_of_union).to(x.dtype))  # (N, U)
    else:
        token_emb = F.linear(hf, first.P.to(x.dtype))  # (N, r)
        scores = torch.einsum("nur,nr->nu", expert_emb, token_emb) / math.sqrt(r)  # (N, U)
    scores = scores.masked_fill(~allowed.to(x.device)[token_part], float("-inf"))
    top_p, topk_idx = scores.softmax(dim=-1).topk(k, dim=-1)  # (N, k) positions in the union
    topk_w = top_p / top_p.sum(dim=-1, keepdim=True)
    delta = amole_delta_dense(expert_emb, B, scaling, topk_idx, topk_w)  # (N, o)
    if shared_name is not None:
        sh = layer.adapters[shared_name]
        delta = delta + F.linear(F.linear(hf, sh.lora_A.to(x.dtype)), sh.lora_B.to(x.dtype)) * sh.scaling
    new = base + delta.view(base.shape).to(base.dtype)
    if recorder is not None:
        recorder.record(layer.layer_name, rows, topk_idx, union)
    return new if whole else out.index_copy(0, rows, new)


def union_ids(setups: Sequence[GroupSetup]) -> tuple[int, ...]:
    """The sorted union of the groups' expert ids."""
    return tuple(sorted({j for s in setups for j in s.experts}))


class ExpertRecorder:
    """Off-by-default hook: the top-k domain-expert ids every routed token chose, by layer and row.

    Set it on :attr:`adapters.amole_routing.AMoLERouting.recorder`; each AMoLE layer then hands it, per client
    group, the batch rows it routed, their tokens' top-k selections as positions in the group's assignment,
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
