"""Pure multi-LoRA math on tensors: dense, gathered (bmm over rows) and the weighted sum of both.

Semantics (the one contract of ARCHITECTURE.md), for x of shape (B, T, d):

    for b in range(B):
        for k in range(K):
            y[b] += w[b, k] * s_k * (x[b] @ A_k.T) @ B_k.T        # w[b, :, k] for per-token weights

An adapter used by every row (FedDPA's shared global adapter) is one dense matmul over the batch;
adapters used by some rows only (each row's local adapter) are gathered into stacked (N, r, d)
tensors and applied with two ``bmm`` over the (row, adapter) pairs, never a Python loop over rows.
Ranks may differ: smaller adapters are zero-padded to the largest rank, which leaves the product
unchanged. The naive loop above lives in the tests as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Return ``s * (x @ A.T) @ B.T`` for one adapter shared by the whole batch.

    Args:
        x: (..., d) input.
        A: (r, d) down projection.
        B: (o, r) up projection.
        scaling: the adapter's ``s``.
    """
    return F.linear(F.linear(x, A), B) * scaling  # (..., o)


def stack_padded(mats: list[torch.Tensor], rank_dim: int) -> torch.Tensor:
    """Stack matrices of possibly different ranks, zero-padding ``rank_dim`` to the largest.

    Args:
        mats: A matrices (r_i, d) with ``rank_dim=0`` or B matrices (o, r_i) with ``rank_dim=1``.
        rank_dim: which axis of each matrix is the rank.

    Returns:
        (N, r_max, d) or (N, o, r_max).
    """
    r_max = max(int(m.shape[rank_dim]) for m in mats)
    padded = []
    for m in mats:
        missing = r_max - int(m.shape[rank_dim])
        if missing:
            pad = (0, 0, 0, missing) if rank_dim == 0 else (0, missing)
            m = F.pad(m, pad)
        padded.append(m)
    return torch.stack(padded)


def gathered_lora_delta(
    xg: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    slots: torch.Tensor,
    coef: torch.Tensor,
) -> torch.Tensor:
    """Return every (row, adapter) pair's weighted LoRA update with two batched matmuls.

    Semantics:
        for n in range(N):
            y[n] = coef[n] * (xg[n] @ A_stack[slots[n]].T) @ B_stack[slots[n]].T

    The caller gathers ``xg = x[rows]`` and scatters back with ``out.index_add(0, rows, y)``.

    Args:
        xg: (N, T, d) input rows of the pairs (already through dropout when training).
        A_stack: (S, r, d) stacked A of the gathered adapters.
        B_stack: (S, o, r) stacked B.
        slots: (N,) index into the stacks for each pair.
        coef: (N, 1, 1) or (N, T, 1): the pair's weight times its adapter's scaling.

    Returns:
        (N, T, o) updates.
    """
    Ag = A_stack.index_select(0, slots)  # (N, r, d)
    Bg = B_stack.index_select(0, slots)  # (N, o, r)
    h = torch.bmm(xg, Ag.transpose(1, 2).to(xg.dtype))  # (N, T, r)
    y = torch.bmm(h, Bg.transpose(1, 2).to(h.dtype))  # (N, T, o)
    return y * coef.to(y.dtype)


def slot_usage(weights: torch.Tensor) -> torch.Tensor:
    """Return a (B, K) bool mask of the (row, adapter) pairs with any non-zero weight."""
    if weights.dim() == 3:
        return (weights != 0).any(dim=1)
    return weights != 0


def weight_column(weights: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Return adapter ``k``'s weights shaped to broadcast over a (B or N, T, o) update."""
    col = weights[..., k]  # (B,) or (B, T)
    if rows is not None:
        col = col.index_select(0, rows)
    return col.unsqueeze(-1) if col.dim() == 2 else col.view(-1, 1, 1)
