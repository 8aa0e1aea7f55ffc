"""Triton fusion of the multi-LoRA shrink: h = (x @ A^T) * w in one pass over A (split over d).

x (N, d) is multiplied by the rank-concatenated A (R, d) of all adapter slots, and each column is
weighted per row by w (N, R) (the row's weight for the slot times its LoRA scaling). In decode N is
small and A is the bulk of the bytes, so the reduction dimension d is split over programs to read A
with the whole GPU: each program (row tile, column tile, d split) writes a float32 partial product,
and a second kernel sums the partials, rounds to the dtype (as torch.mm does), weights and rounds
again (as torch's mul). With one split the first kernel applies that epilogue itself.

The split count comes from shapes and the SM count only, so the launcher is CUDA-graph capturable.
serving.engine.kernels keeps torch's mm + mul as the default unless bench/gpu_kernels.py shows this wins.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from serving.engine.kernels.triton_ops import INTERPRETED, round_to

BLOCK_M = 16  # rows per tile (tl.dot needs >= 16)
BLOCK_R = 32  # columns of A per tile
BLOCK_K = 64  # reduction step
CPU_SM_COUNT = 4  # stands in for the SM count when the interpreter runs on CPU


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property query, no synchronisation)."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def split_plan(n: int, r: int, d: int, device: torch.device) -> tuple[int, int]:
    """How lora_shrink splits d: (splits, k_steps), each split covering k_steps * BLOCK_K of d.

    Args:
        n: rows N.
        r: columns R.
        d: reduction length.
        device: where the kernels run.

    Returns:
        (splits, k_steps): about two programs per SM in all, at least one BLOCK_K step per split.
    """
    tiles = triton.cdiv(n, BLOCK_M) * triton.cdiv(r, BLOCK_R)
    steps = triton.cdiv(d, BLOCK_K)
    splits = max(1, min(triton.cdiv(2 * _sm_count(device), tiles), steps))
    k_steps = triton.cdiv(steps, splits)
    return triton.cdiv(steps, k_steps), k_steps


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, w_ptr, h_ptr, part_ptr,
    N, R, d,
    sx, sa, sw, sh, sp_k, sp_n,
    K_STEPS: tl.constexpr, SINGLE: tl.constexpr, F32_DOT: tl.constexpr,
    BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
):
    """Program (row tile, column tile, split): a (BM, BR) tile of x @ A^T over one range of d."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BR + tl.arange(0, BR)
    split = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    row_ok = rows < N
    col_ok = cols < R
    acc = tl.zeros([BM, BR], dtype=tl.float32)
    for i in range(K_STEPS):
        ks = (split * K_STEPS + i) * BK + offs_k  # (BK,)
        k_ok = ks < d
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * sx + ks[None, :]  # (BM, BK)
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_ptrs = a_ptr + cols[None, :].to(tl.int64) * sa + ks[:, None]  # (BK, BR): A^T's tile
        at = tl.load(a_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if F32_DOT:  # float32 inputs (as torch.mm: no TF32), or the interpreter (its bf16 dot is wrong)
            acc += tl.dot(x.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, at)  # (BM, BR), float32 accumulation
    mask = row_ok[:, None] & col_ok[None, :]
    if SINGLE:
        dt = h_ptr.dtype.element_ty
        w = tl.load(w_ptr + rows[:, None] * sw + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = round_to(round_to(acc, dt) * w, dt)
        tl.store(h_ptr + rows[:, None] * sh + cols[None, :], h.to(dt), mask=mask)
    else:
        tl.store(part_ptr + split * sp_k + rows[:, None] * sp_n + cols[None, :], acc, mask=mask)


@triton.jit
def _shrink_epilogue_kernel(
    part_ptr, w_ptr, h_ptr, R, sp_k, sp_n, sw, sh, SPLITS: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (row, column block): sums the splits' partials, rounds, weights, rounds."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < R
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * sp_k + row * sp_n + cols, mask=ok, other=0.0)
    dt = h_ptr.dtype.element_ty
    w = tl.load(w_ptr + row * sw + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * sh + cols, round_to(round_to(acc, dt) * w, dt).to(dt), mask=ok)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Triton launcher of serving.engine.kernels.reference.lora_shrink (same arguments and result).

    Args:
        x: (N, d) inputs.
        a: (R, d) stacked A matrices.
        w: (N, R) per-row, per-column weights (any float dtype; read as float32).
        splits: force this many d splits (tests); None: split_plan's choice.

    Returns:
        (N, R) in x.dtype.
    """
    n, d = x.shape
    r = a.shape[0]
    assert a.shape[1] == d and w.shape == (n, r) and x.dtype == a.dtype
    assert x.stride(-1) == 1 and a.stride(-1) == 1 and w.stride(-1) == 1
    if splits is None:
        splits, k_steps = split_plan(n, r, d, x.device)
    else:
        k_steps = triton.cdiv(triton.cdiv(d, BLOCK_K), splits)
        splits = triton.cdiv(triton.cdiv(d, BLOCK_K), k_steps)
    h = torch.empty((n, r), dtype=x.dtype, device=x.device)  # (N, R)
    part = h if splits == 1 else torch.empty((splits, n, r), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(r, BLOCK_R), splits)
    _shrink_kernel[grid](
        x, a, w, h, part, n, r, d,
        x.stride(0), a.stride(0), w.stride(0), h.stride(0), part.stride(0), part.stride(-2),
        K_STEPS=k_steps, SINGLE=splits == 1, F32_DOT=x.dtype == torch.float32 or INTERPRETED,
        BM=BLOCK_M, BR=BLOCK_R, BK=BLOCK_K, num_warps=4,
    )
    if splits > 1:
        block = min(1024, triton.next_power_of_2(r))
        _shrink_epilogue_kernel[(n, triton.cdiv(r, block))](
            part, w, h, r, part.stride(0), part.stride(1), w.stride(0), h.stride(0),
            SPLITS=splits, BLOCK=block, num_warps=4,
        )
    return h
