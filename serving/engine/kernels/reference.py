"""Plain-PyTorch decode-step operations: the semantics of every fused kernel, and the CPU path.

Each function rounds at the same points as the Hugging Face Llama modules it replaces (one rounding to
the activation dtype per PyTorch op), so a model run through these functions gives the same tensors as
`transformers`' LlamaRMSNorm, apply_rotary_pos_emb and LlamaMLP. Attention on the CPU, prefill and decode
alike, is :func:`invariant_attention`: each query's result depends on that query and its row's keys only,
not on the batch, the longest row or the chunk's query count (greedy reproducibility, docs/serving.md;
PyTorch's fused SDPA, used before, rounded a token differently cold, after a cached prefix and beside a
longer row), with scores, softmax and the weighted sum in float32. On CUDA, where the Triton kernels
serve and this module is their yardstick, attention is PyTorch's SDPA with the weights in float32 (the
kernels' own rounding), and decode attention materialises its scores (capturable in a CUDA graph).

Stale cache cells (past a row's length) are read at weight 0 and must be finite, keys included:
``SlotKV.release`` zeroes what an owner wrote.

Nothing here synchronises with a GPU when the tensors are on CUDA (no `.item()`, no data-dependent
shapes), so the reference is also CUDA-graph capturable; on CPU the attention functions read the caches
only up to the longest row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A large finite negative score for masked positions (CUDA's decode path): a row with no valid position
# then gets uniform weights over finite stale values (a finite result of no meaning) instead of NaN.
_MASKED = torch.finfo(torch.float32).min
# Keys per block of the CPU attention (invariant_attention): its weighted sums reduce over one block at a time.
KEY_BLOCK = 64


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add (optional) and LlamaRMSNorm.

    Args:
        x: (N, H) hidden states.
        weight: (H,) norm weight.
        eps: variance epsilon.
        residual: (N, H) residual stream to add to `x` first, or None.

    Returns:
        (out, residual_out): out (N, H) = weight * rms-normalised s, with s = x + residual rounded to
        x.dtype (or s = x); residual_out is s (x itself when no residual is given).
    """
    s = x if residual is None else x + residual  # (N, H), one rounding to x.dtype
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # (N, H) fp32
    return weight * h.to(s.dtype), s


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: cat(-x2, x1) of the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of q and k, and the write of rotated k and v into the caches.

    Args:
        q: (N, Hq, D) queries.
        k: (N, Hkv, D) keys.
        v: (N, Hkv, D) values.
        cos: (N, D) per-token cosines (HF's, in the activation dtype, halves duplicated).
        sin: (N, D) per-token sines.
        k_cache: (S, Hkv, Lmax, D) key cache, written in place.
        v_cache: (S, Hkv, Lmax, D) value cache, written in place.
        slots: (N,) int64 cache row of each token.
        positions: (N,) int64 position of each token in its row.

    Returns:
        (N, Hq, D) rotated queries (a new tensor).
    """
    c, s = cos[:, None, :], sin[:, None, :]  # (N, 1, D)
    q_rot = (q * c) + (rotate_half(q) * s)  # (N, Hq, D)
    k_rot = (k * c) + (rotate_half(k) * s)  # (N, Hkv, D)
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is (N, Hkv, D).
    # The caches hold the compute dtype; under CPU autocast the rotation promotes to fp32 (cos/sin are).
    k_cache[slots, :, positions] = k_rot.to(k_cache.dtype)
    v_cache[slots, :, positions] = v.to(v_cache.dtype)
    return q_rot


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a fused gate/up projection.

    Args:
        gate_up: (N, 2I) with gate in [..., :I] and up in [..., I:].

    Returns:
        (N, I) silu(gate) * up, the silu rounded to the dtype before the product (as HF's LlamaMLP).
    """
    gate, up = gate_up.chunk(2, dim=-1)  # (N, I) each
    return torch.nn.functional.silu(gate) * up


def _consecutive(cache: torch.Tensor, slots: torch.Tensor) -> int | None:
    """The first slot when ``slots`` are consecutive and ascending on a CPU cache (their rows are then a
    view of the cache), else None. Never reads a CUDA tensor (no host synchronisation)."""
    if cache.is_cuda:
        return None
    s = slots.tolist()
    return s[0] if s == list(range(s[0], s[0] + len(s))) else None


def _gather_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' keys and values up to the longest row, and which positions are valid.

    Positions past a row's length hold stale cells that must be finite, keys and values alike (SDPA adds
    the mask to the scores, so a NaN key would survive it, and a NaN value times its exact 0 weight is
    NaN): ``SlotKV.release`` zeroes what an owner wrote, so a NaN-producing request cannot poison its
    slot's next owner.

    Args:
        k_cache: (S, Hkv, Lmax, D) key cache.
        v_cache: (S, Hkv, Lmax, D) value cache (same layout).
        slots: (B,) int64 cache rows.
        lengths: (B,) int64 valid positions per row.

    Returns:
        (k, v, valid): k and v (B, Hkv, L, D) in the cache dtype, valid (B, L) bool, position 0 valid in
        every row (an empty padding row then reads finite stale cells instead of producing NaN).
        Read-only: on CPU, consecutive slots give a view of the cache. L is Lmax on CUDA (no host
        synchronisation) and the longest row's length on CPU.
    """
    # one plan for both caches: the longest length and the slot check each read the host once
    length = k_cache.shape[2] if k_cache.is_cuda else int(lengths.max())
    valid = torch.arange(length, device=k_cache.device)[None, :] < lengths.clamp(min=1)[:, None]  # (B, L)
    first = _consecutive(k_cache, slots)
    if first is not None:  # (B, Hkv, L, D) views, no copy
        rows = slice(first, first + slots.shape[0])
        return k_cache[rows, :, :length], v_cache[rows, :, :length], valid
    # 5x a fancy index on CPU
    return k_cache[:, :, :length].index_select(0, slots), v_cache[:, :, :length].index_select(0, slots), valid


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per row over its cache row (GQA as HF's repeat_kv).

    Args:
        q: (B, Hq, D) queries, Hq = G * Hkv; query head h reads kv head h // G.
        k_cache: (S, Hkv, Lmax, D) key cache.
        v_cache: (S, Hkv, Lmax, D) value cache.
        slots: (B,) int64 cache row of each query.
        lengths: (B,) int64 valid positions of each row (>= 1, the current token included).
        scale: score scale (usually D ** -0.5).

    Returns:
        (B, Hq, D) softmax(q K^T * scale) V over positions [0, lengths[b]), in q.dtype.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if not q.is_cuda:  # one query per row is a chunk of one token: the same invariant attention as a prefill
        return invariant_attention(q.view(b, 1, hq, d), k_cache, v_cache, slots, lengths - 1, lengths,
                                   scale).view(b, hq, d)
    k, v, valid = _gather_rows(k_cache, v_cache, slots, lengths)  # (B, Hkv, L, D) each, (B, L)
    # a kv head's G query heads are G queries of one attention over that head: no repeated K/V
    qg = q.view(b, hkv, hq // hkv, d)  # (B, Hkv, G, D)
    # CUDA from here: the Triton kernel's yardstick, float32 weights and materialised scores (capturable)
    with torch.autocast(q.device.type, enabled=False):  # as documented, whatever autocast is on
        scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale  # (B, Hkv, G, L)
        probs = torch.softmax(scores.masked_fill_(~valid[:, None, None, :], _MASKED), dim=-1)
        out = torch.matmul(probs, v.float())  # (B, Hkv, G, D)
    return out.reshape(b, hq, d).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk of new tokens per row over the row's cache (chunked prefill).

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
        queries (t >= n_b) get finite values of no meaning.
    """
    if not q.is_cuda:
        return invariant_attention(q, k_cache, v_cache, slots, starts, lengths, scale)
    t = q.shape[1]
    k, v, valid = _gather_rows(k_cache, v_cache, slots, lengths)  # (B, Hkv, L, D) each, (B, L)
    query_pos = starts[:, None] + torch.arange(t, device=q.device)[None, :]  # (B, T)
    key_pos = torch.arange(k.shape[2], device=q.device)  # (L,)
    # (B, T, L): every query sees position 0 at least, so no row of the softmax is fully masked
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & valid[:, None, :]
    with torch.autocast(q.device.type, enabled=False):  # as documented, whatever autocast is on
        # CUDA from here: one fused kernel in float32 (as decode_attention) instead of materialised
        # (B, Hq, T, L) scores
        out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float(), v.float(),
                                             attn_mask=allowed[:, None], scale=scale, enable_gqa=True)  # (B, Hq, T, D)
    return out.transpose(1, 2).to(q.dtype)


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention whose every query's result depends on that query and its row's keys alone (CPU).

    Bit for bit the same whatever else the call holds: how many rows, how long the longest is, where
    the chunk starts, how many queries it has. PyTorch's fused SDPA is not: its reductions follow the
    longest row and the number of queries, so a prompt computed whole, after a cached prefix, in
    chunks, or beside other prompts gave its tokens different roundings, and greedy answers on a near
    tie differed. Here the keys are cut in blocks of :data:`KEY_BLOCK` counted from position 0; every
    product reduces over a fixed length (``D`` for the scores, one block for the weighted values), the
    block partials are added in position order, and masked positions add exact zeros. Scores, softmax
    and the weighted sum are float32 (the bf16 cache read as float32), rounded once to ``q.dtype``.

    Args:
        q: (B, T, Hq, D) each row's new queries; row b's real ones are q[b, :lengths[b] - starts[b]].
        k_cache: (S, Hkv, Lmax, D) key cache, the chunk's keys already written.
        v_cache: (S, Hkv, Lmax, D) value cache, likewise.
        slots: (B,) int64 cache rows.
        starts: (B,) int64 position of each row's first query.
        lengths: (B,) int64 starts + real query counts.
        scale: score scale.

    Returns:
        (B, T, Hq, D) in q.dtype: query t of row b attends to positions [0, starts[b] + t]; padded
        queries get finite values of no meaning.
    """
    b, t, hq, d = q.shape
    hkv, lmax = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    width = -(-int(lengths.max()) // KEY_BLOCK) * KEY_BLOCK  # the longest row, in whole blocks
    k, v, _ = _gather_rows(k_cache, v_cache, slots, torch.full_like(lengths, min(width, lmax)))  # (B, Hkv, W', D)
    if width > lmax:  # a cache shorter than whole blocks: zero keys past its end, masked below
        k, v = F.pad(k, (0, 0, 0, width - lmax)), F.pad(v, (0, 0, 0, width - lmax))
    nb = width // KEY_BLOCK
    # queries of one kv head side by side (its G heads for each of the T positions): no repeated K/V
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)  # (B, Hkv, T G, D)
    rows = t * g
    if rows == 1:  # a matrix-vector product rounds unlike a matrix product: compute one more (ignored) row
        qg = torch.cat([qg, qg], dim=2)
    query_pos = (starts[:, None] + torch.arange(t, device=q.device)[None, :]).repeat_interleave(g, dim=1)  # (B, T G)
    key_pos = torch.arange(width, device=q.device)
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < lengths[:, None, None])
    allowed |= key_pos[None, None, :] == 0  # every query sees position 0: no softmax row is fully masked
    if rows == 1:
        allowed = torch.cat([allowed, allowed], dim=1)
    with torch.autocast(q.device.type, enabled=False):  # float32 whatever autocast is on
        # (B, Hkv, TG, W): D-long sums; the scale on the TG x D queries rather than on the scores
        scores = torch.matmul(qg.float() * scale, k.float().transpose(-1, -2))
        scores.masked_fill_(~allowed[:, None], float("-inf"))
        probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # the max is exact in any order
        # per block [p_blk @ v_blk | sum p_blk]: the weighted values and the softmax's denominator in one product
        ones = v.new_ones(v.shape[:-1] + (1,)).float()
        vx = torch.cat([v.float(), ones], dim=-1).view(b, hkv, nb, KEY_BLOCK, d + 1)  # (B, Hkv, nb, K, D + 1)
        pb = probs.view(b, hkv, -1, nb, KEY_BLOCK).transpose(2, 3)  # (B, Hkv, nb, TG, K)
        parts = torch.matmul(pb, vx)  # (B, Hkv, nb, TG, D + 1)
        acc = parts[:, :, 0]
        for j in range(1, nb):  # in position order; blocks past a row's length add exact zeros
            acc = acc + parts[:, :, j]
        out = acc[..., :d] / acc[..., d:]  # (B, Hkv, TG, D)
    out = out[:, :, :rows].reshape(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    return out.to(q.dtype)
