"""CPU attention over the engine's slots: each row reads its own cache row as a view (issue 14).

The reference functions (:mod:`serving.kernels.reference`) are written for the GPU: no host
synchronisation, so they gather every row's cache up to the longest row into one padded
``(B, Hkv, L, D)`` copy, convert it to float32 and mask it, per layer and for K and V. On a CPU that
copying is most of a decode step's attention: at 57 rows of about 150 positions it moved about 40 MB
per layer, for a computation that reads a fifth of that. Here each row attends over
``cache[slot, :, :length]``, a view of exactly its valid positions, with PyTorch's fused
``scaled_dot_product_attention`` (float32 accumulation, one rounding of the output, as the reference).
Nothing past a row's length is read, so no masking is needed and stale cache cells can hold anything.

Grouped-query attention needs no repeated K/V: the G query heads that share a KV head are laid out as
G queries of that head (``(Hkv, G * T, D)``), which is exact because the heads never mix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row over its cache row: :func:`serving.kernels.reference.decode_attention`.

    Args:
        q: (B, Hq, D) queries, Hq = G * Hkv; query head h reads KV head h // G.
        k_cache: (S, Hkv, Lmax, D) key cache.
        v_cache: (S, Hkv, Lmax, D) value cache.
        slots: (B,) int64 cache row of each query.
        lengths: (B,) int64 valid positions of each row (>= 1).
        scale: score scale.

    Returns:
        (B, Hq, D) in q.dtype.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    with torch.autocast(q.device.type, enabled=False):
        for i, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
            k = k_cache[slot, :, :length].to(q.dtype)  # (Hkv, L, D): a view when the dtypes agree
            v = v_cache[slot, :, :length].to(q.dtype)
            qg = q[i].reshape(hkv, hq // hkv, d)  # (Hkv, G, D): the G heads of a KV head as G queries
            out[i] = F.scaled_dot_product_attention(qg, k, v, scale=scale).view(hq, d)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      starts: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal chunked-prefill attention per row: :func:`serving.kernels.reference.prefill_attention`.

    Args:
        q: (B, T, Hq, D) each row's new chunk; row b's real tokens are q[b, :n_b], then padding.
        k_cache: (S, Hkv, Lmax, D) key cache, the chunk's keys already written.
        v_cache: (S, Hkv, Lmax, D) value cache, the chunk's values already written.
        slots: (B,) int64 cache rows.
        starts: (B,) int64 position of each row's first new token.
        lengths: (B,) int64 starts + n_b.
        scale: score scale.

    Returns:
        (B, T, Hq, D) in q.dtype: query t of row b attends to positions [0, starts[b] + t]; padded
        queries (t >= n_b) are 0.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.zeros_like(q)
    with torch.autocast(q.device.type, enabled=False):
        for i, (slot, start, length) in enumerate(zip(slots.tolist(), starts.tolist(), lengths.tolist(),
                                                      strict=True)):
            n = length - start
            k = k_cache[slot, :, :length].to(q.dtype)  # (Hkv, L, D)
            v = v_cache[slot, :, :length].to(q.dtype)
            # (n, Hq, D) -> (Hkv, G * n, D): query g * n + j is token j of head kv * G + g
            qg = q[i, :n].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            # key p is visible to token j when p <= start + j (an explicit mask: is_causal would align the
            # G blocks of queries as one long sequence)
            allowed = torch.arange(length, device=q.device)[None, :] <= \
                start + torch.arange(n, device=q.device)[:, None]  # (n, L)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=allowed.repeat(g, 1), scale=scale)
            out[i, :n] = o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
    return out
