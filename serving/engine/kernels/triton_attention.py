"""Triton decode attention over a slot-indexed KV cache (flash-decoding: split the length, then reduce).

One query token per row attends to positions [0, lengths[b]) of its cache row k_cache[slots[b]]. The
first kernel gives each (row, query head, split) program a contiguous chunk of the row and keeps an
online softmax over it in float32; when there is more than one split, it writes the chunk's normalised
output and log-sum-exp, and a second kernel merges the splits of each (row, head). Programs whose chunk
starts past the row's length do nothing, and the merge reads only the splits that hold data, so no
position past a row's length is ever read.

The split size comes from Lmax only (split_plan: 256 positions per split up to 16k-position caches),
never from `lengths`, so the launcher is CUDA-graph capturable and a batch of one row with a 4k context
still runs 16 programs per head. The loop over a split has a fixed trip count (the interpreter cannot run
loops with data-dependent bounds, and the compiler pipelines fixed loops). Each program serves one query
head; with GQA (G query heads per kv head) the G programs of a group read the same keys, mostly from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.engine.kernels.triton_ops import next_pow2, round_to

# Cache positions per loop step: a (BLOCK, D) tile of 4096 elements at most, 32 per thread with 4 warps
# (about 128 registers for sm_90 at D = 64 and 128, no spills; larger tiles reach the 255-register cap).
TILE_ELEMENTS = 4096
MAX_BLOCK = 64
MIN_CHUNK = 256  # positions per split (a power of two), unless the cache is long
MAX_SPLITS = 64


def split_plan(lmax: int, chunk: int | None = None) -> tuple[int, int]:
    """How decode_attention splits the cache length: (splits, chunk).

    Args:
        lmax: cache capacity per row (a shape, so the plan is the same for every batch of a CUDA graph).
        chunk: force this many positions per split (a power of two >= 16; tests); None chooses
            max(MIN_CHUNK, lmax / MAX_SPLITS rounded up to a power of two), at most lmax rounded up.

    Returns:
        (splits, chunk): split s covers positions [s * chunk, (s + 1) * chunk); splits * chunk >= lmax.
    """
    if chunk is None:  # short caches: one split of the cache's length, rounded up to a power of two
        chunk = min(max(MIN_CHUNK, next_pow2(triton.cdiv(lmax, MAX_SPLITS))), max(16, next_pow2(lmax)))
    assert chunk >= 16 and chunk & (chunk - 1) == 0, "chunk must be a power of two >= 16"
    return triton.cdiv(lmax, chunk), chunk


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, part_ptr, lse_ptr,
    scale,
    sq_b, sq_h, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, so_b, so_h,
    sp_b, sp_h, sp_s, sl_b, sl_h,
    G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
):
    """Program (b, h, split): online softmax of query head h of row b over one chunk of its cache row."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, length)
    if start < end:
        slot = tl.load(slot_ptr + b)
        kvh = h // G
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_d).to(tl.float32)  # (D,)
        k_row = k_ptr + slot * sk_s + kvh * sk_h
        v_row = v_ptr + slot * sv_s + kvh * sv_h
        m_i = float("-inf")  # running max of the scores
        l_i = 0.0  # running sum of exp(score - m_i)
        acc = tl.zeros([D], dtype=tl.float32)  # running sum of exp(score - m_i) * v
        # A fixed trip count (pipelined by the compiler; the last chunk's steps past `end` load nothing).
        for i in range(CHUNK // BLOCK):
            pos = start + i * BLOCK + offs_n  # (BLOCK,)
            valid = pos < end
            k = tl.load(k_row + pos[:, None] * sk_l + offs_d[None, :], mask=valid[:, None], other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale  # (BLOCK,)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)  # (BLOCK,), 0 where masked
            v = tl.load(v_row + pos[:, None] * sv_l + offs_d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)  # (D,)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        if SINGLE:
            dt = out_ptr.dtype.element_ty
            tl.store(out_ptr + b * so_b + h * so_h + offs_d, round_to(acc / l_i, dt).to(dt))
        else:
            tl.store(part_ptr + b * sp_b + h * sp_h + split * sp_s + offs_d, acc / l_i)
            tl.store(lse_ptr + b * sl_b + h * sl_h + split, m_i + tl.log(l_i))


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, len_ptr, out_ptr,
    sp_b, sp_h, sp_s, sl_b, sl_h, so_b, so_h,
    D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (b, h): the splits' outputs weighted by their shares of the softmax mass."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    length = tl.load(len_ptr + b).to(tl.int32)
    n_valid = (length + CHUNK - 1) // CHUNK  # splits that hold data
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    valid = offs_s < n_valid
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + offs_s, mask=valid, other=float("-inf"))  # (BLOCK_S,)
    w = tl.exp(lse - tl.max(lse, axis=0))  # 0 for the empty splits
    parts = tl.load(
        part_ptr + b * sp_b + h * sp_h + offs_s[:, None] * sp_s + offs_d[None, :], mask=valid[:, None], other=0.0
    )  # (BLOCK_S, D)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + b * so_b + h * so_h + offs_d, round_to(out, dt).to(dt))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """Triton launcher of serving.engine.kernels.reference.decode_attention (same arguments and result).

    Args:
        q: (B, Hq, D) queries.
        k_cache: (S, Hkv, Lmax, D) key cache.
        v_cache: (S, Hkv, Lmax, D) value cache.
        slots: (B,) int64 cache rows.
        lengths: (B,) int64 valid positions per row (>= 1).
        scale: score scale.
        chunk: force the positions per split (a power of two >= 16; tests); None: split_plan's choice.

    Returns:
        (B, Hq, D) attention output in q.dtype.
    """
    b, hq, d = q.shape
    hkv, lmax = k_cache.shape[1], k_cache.shape[2]
    assert hq % hkv == 0 and d >= 16 and d & (d - 1) == 0, "need Hq = G * Hkv and a power-of-two D >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert slots.is_contiguous() and lengths.is_contiguous()
    splits, chunk = split_plan(lmax, chunk)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)  # (B, Hq, D)
    if splits == 1:
        part, lse = out, out  # unused placeholders
    else:
        part = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)  # (B, Hq, splits, D)
        lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)  # (B, Hq, splits)
    _decode_split_kernel[(b, hq, splits)](
        q, k_cache, v_cache, slots, lengths, out, part, lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        G=hq // hkv, D=d, CHUNK=chunk, BLOCK=min(MAX_BLOCK, TILE_ELEMENTS // d, chunk), SINGLE=splits == 1, num_warps=4,
    )
    if splits > 1:
        _decode_merge_kernel[(b, hq)](
            part, lse, lengths, out,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            D=d, CHUNK=chunk, BLOCK_S=next_pow2(splits), num_warps=4,
        )
    return out
