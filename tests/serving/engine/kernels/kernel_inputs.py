"""Random inputs for the serving.engine.kernels tests (CPU interpreter and CUDA): fresh data, poisoned caches.

Every cache cell that a kernel must not write holds NaN (rotary cases) or a huge finite value (attention
cases: stale cells are finite by the cache's contract, and a kernel reads them at weight 0 at most), so a
stray write shows up as a NaN that disappeared and a stray read as a huge value in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rand(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, gen: torch.Generator) -> torch.Tensor:
    """Standard-normal values (drawn in float32 on CPU from `gen`, then cast and moved)."""
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


@dataclass
class AttentionCase:
    """A decode / prefill attention input: caches valid up to each row's length, 1e4 elsewhere."""

    q: torch.Tensor  # (B, Hq, D) or (B, T, Hq, D)
    k_cache: torch.Tensor  # (S, Hkv, Lmax, D)
    v_cache: torch.Tensor  # (S, Hkv, Lmax, D)
    slots: torch.Tensor  # (B,) int64, distinct rows
    lengths: torch.Tensor  # (B,) int64
    scale: float


def attention_case(
    hq: int,
    hkv: int,
    d: int,
    lmax: int,
    lengths: list[int],
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    chunk: int | None = None,
) -> AttentionCase:
    """Random queries and caches for len(lengths) rows in distinct slots of a cache with one spare row.

    Args:
        hq: query heads.
        hkv: kv heads.
        d: head dim.
        lmax: cache capacity per row.
        lengths: valid positions per row (<= lmax).
        dtype: activation dtype.
        device: where the tensors live.
        seed: generator seed.
        chunk: None for decode queries (B, Hq, D); else prefill queries (B, chunk, Hq, D).

    Returns:
        The case; cache rows are assigned in reverse order so slot != batch index.
    """
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    s = b + 1
    # stale cells: large finite keys and values (the cache's contract: SlotKV.release zeroes what an owner
    # wrote; SDPA adds the mask to the scores, so a NaN key would survive it)
    k_cache = torch.full((s, hkv, lmax, d), 1e4, dtype=dtype, device=device)
    v_cache = torch.full((s, hkv, lmax, d), 1e4, dtype=dtype, device=device)
    slots = torch.arange(s - 1, 0, -1, device=device)  # rows S-1 .. 1; row 0 stays stale
    for row, length in zip(slots.tolist(), lengths, strict=True):
        k_cache[row, :, :length] = rand((hkv, length, d), dtype, device, gen)
        v_cache[row, :, :length] = rand((hkv, length, d), dtype, device, gen)
    q_shape = (b, hq, d) if chunk is None else (b, chunk, hq, d)
    return AttentionCase(
        q=rand(q_shape, dtype, device, gen),
        k_cache=k_cache,
        v_cache=v_cache,
        slots=slots,
        lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
        scale=d**-0.5,
    )


@dataclass
class RotaryCase:
    """A rotary_kv_write input: tokens, HF-style cos/sin and NaN caches."""

    q: torch.Tensor  # (N, Hq, D)
    k: torch.Tensor  # (N, Hkv, D)
    v: torch.Tensor  # (N, Hkv, D)
    cos: torch.Tensor  # (N, D)
    sin: torch.Tensor  # (N, D)
    k_cache: torch.Tensor  # (S, Hkv, Lmax, D), all NaN
    v_cache: torch.Tensor  # (S, Hkv, Lmax, D), all NaN
    slots: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64, distinct (slot, position) pairs


def rotary_case(
    n: int, hq: int, hkv: int, d: int, s: int, lmax: int, dtype: torch.dtype, device: str | torch.device, seed: int
) -> RotaryCase:
    """N tokens at distinct random (slot, position) cells, cos/sin as HF's rotary embedding makes them.

    Args:
        n: tokens (<= s * lmax).
        hq: query heads.
        hkv: kv heads.
        d: head dim.
        s: cache rows.
        lmax: cache capacity per row.
        dtype: activation dtype.
        device: where the tensors live.
        seed: generator seed.

    Returns:
        The case.
    """
    gen = torch.Generator().manual_seed(seed)
    cells = torch.randperm(s * lmax, generator=gen)[:n]
    slots, positions = cells // lmax, cells % lmax
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions[:, None].float() * inv_freq  # (N, D/2), as LlamaRotaryEmbedding
    emb = torch.cat((freqs, freqs), dim=-1)
    nan = torch.full((s, hkv, lmax, d), float("nan"), dtype=dtype, device=device)
    return RotaryCase(
        q=rand((n, hq, d), dtype, device, gen),
        k=rand((n, hkv, d), dtype, device, gen),
        v=rand((n, hkv, d), dtype, device, gen),
        cos=emb.cos().to(dtype=dtype, device=device),
        sin=emb.sin().to(dtype=dtype, device=device),
        k_cache=nan,
        v_cache=nan.clone(),
        slots=slots.to(device),
        positions=positions.to(device),
    )
