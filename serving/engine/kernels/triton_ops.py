"""Triton kernels for the decode step's elementwise work: RMSNorm, rotary + KV-cache write, SiLU-mul.

Importing this module imports triton (serving.engine.kernels imports it only when a Triton path is wanted).
The kernels are compiled for CUDA tensors, or run on CPU tensors by Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was first imported (one or the other per process: see
INTERPRETED). Kernel parameters carry no type hints on purpose: Triton reads annotations as types
(`tl.constexpr` marks compile-time constants). The launchers never synchronise with the host: grids and
block sizes come from shapes only and outputs are allocated with torch.empty, so each launcher can be
captured in a CUDA graph.

All kernels load in the activation dtype, compute in float32 and round to the dtype (round_to) exactly
where the PyTorch reference (serving.engine.kernels.reference) rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# True when this process runs Triton kernels in the CPU interpreter (TRITON_INTERPRET=1 was set before
# triton was imported: triton.language's own helpers, tl.sum included, are interpreted too).
INTERPRETED: bool = isinstance(tl.sum, InterpretedFunction)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@triton.jit
def round_to(x, DT: tl.constexpr):
    """x (float32) rounded to the nearest DT value (ties to even), returned as float32.

    bfloat16 is rounded with integer arithmetic on the float32 bits: the same result as the GPU's
    cvt.rn.bf16.f32 (and PyTorch's casts), and also right in Triton's interpreter, whose own fp32 to
    bf16 cast truncates. NaN stays NaN (its payload aside).
    """
    y = x
    if DT == tl.bfloat16:  # a compile-time branch
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits, rounded
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif DT == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  # (N, H) rows; w (H,)
    H, eps,
    sx, sr, so, sro,  # row strides
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row): residual add, mean square over the row's H values, normalise, weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    s = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * sr + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(s + r, x_ptr.dtype.element_ty)  # HF: residual + hidden, rounded once
        tl.store(res_out_ptr + row * sro + offs, s.to(res_out_ptr.dtype.element_ty), mask=mask)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
    h = round_to(s * inv, x_ptr.dtype.element_ty)  # h.to(input dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * so + offs, round_to(w * h, out_dt).to(out_dt), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of serving.engine.kernels.reference.rms_norm (same arguments and results)."""
    n, hidden = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous(), "rows must be contiguous"
    out = torch.empty((n, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res = x if residual is None else residual  # (N, H)
    assert res.stride(-1) == 1 and res.dtype == x.dtype, "residual rows: contiguous, in x.dtype"
    res_out = x if residual is None else torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    block = next_pow2(hidden)
    _rms_norm_kernel[(n,)](
        x, res, weight, out, res_out, hidden, eps,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )
    return out, res_out


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sc_n, sqo_n, sqo_h,  # token / head strides
    skc_s, skc_h, skc_l, svc_s, svc_h, svc_l,  # cache strides (slot, head, position)
    HQ: tl.constexpr, HALF: tl.constexpr,
):
    """Program (token, head): heads [0, HQ) are query heads, [HQ, HQ + Hkv) key/value heads."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    lo = tl.arange(0, HALF)  # first half of the head dim; the second is lo + HALF
    c1 = tl.load(cos_ptr + tok * sc_n + lo).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * sc_n + HALF + lo).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * sc_n + lo).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * sc_n + HALF + lo).to(tl.float32)
    dt = q_ptr.dtype.element_ty
    if head < HQ:
        src = q_ptr + tok * sq_n + head * sq_h
        dst = qo_ptr + tok * sqo_n + head * sqo_h
    else:
        kvh = head - HQ
        slot = tl.load(slot_ptr + tok)
        pos = tl.load(pos_ptr + tok)
        src = k_ptr + tok * sk_n + kvh * sk_h
        dst = kc_ptr + slot * skc_s + kvh * skc_h + pos * skc_l
        v = tl.load(v_ptr + tok * sv_n + kvh * sv_h + tl.arange(0, 2 * HALF))
        tl.store(vc_ptr + slot * svc_s + kvh * svc_h + pos * svc_l + tl.arange(0, 2 * HALF), v)
    x1 = tl.load(src + lo).to(tl.float32)
    x2 = tl.load(src + HALF + lo).to(tl.float32)
    # HF: (x * cos) + (rotate_half(x) * sin), each product and the sum rounded to the dtype.
    o1 = round_to(round_to(x1 * c1, dt) + round_to(-x2 * s1, dt), dt)
    o2 = round_to(round_to(x2 * c2, dt) + round_to(x1 * s2, dt), dt)
    tl.store(dst + lo, o1.to(dt))
    tl.store(dst + HALF + lo, o2.to(dt))


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
    """Triton launcher of serving.engine.kernels.reference.rotary_kv_write (same arguments and result)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    assert d >= 2 and d & (d - 1) == 0, "head dim must be a power of two"
    for t in (q, k, v, cos, sin, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dim must be contiguous"
    assert cos.stride() == sin.stride() and slots.is_contiguous() and positions.is_contiguous()
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)  # (N, Hq, D)
    _rotary_kv_kernel[(n, hq + hkv)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slots, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=hq, HALF=d // 2, num_warps=1,
    )
    return q_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, sgu, so, BLOCK: tl.constexpr):
    """Program (row, column block): silu(gate) * up for BLOCK columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dt = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * sgu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * sgu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dt)  # silu, rounded as F.silu's output
    tl.store(out_ptr + row * so + offs, round_to(act * up, dt).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton launcher of serving.engine.kernels.reference.silu_mul (same argument and result)."""
    n, two_i = gate_up.shape
    assert gate_up.stride(-1) == 1 and two_i % 2 == 0
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)  # (N, I)
    block = min(1024, next_pow2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out
