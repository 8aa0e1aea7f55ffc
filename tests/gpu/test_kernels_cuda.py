"""serving.engine.kernels' compiled Triton kernels on an NVIDIA GPU: equal to the reference at LLaMA-7B and SmolLM2
sizes in bfloat16 and float32, and each launcher captured in a CUDA graph and replayed on new values.

Skips without CUDA, without triton, or when this process runs Triton in its interpreter.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from serving.engine import kernels
from serving.engine.kernels import reference
from tests.serving.engine.kernels.kernel_inputs import attention_case, rand, rotary_case


def _compiled_triton() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    return kernels.uses_triton(torch.zeros(1, device="cuda"))


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _compiled_triton(), reason="needs an NVIDIA GPU and compiled triton"),
]

T = TypeVar("T")
DTYPES = [torch.bfloat16, torch.float32]
# (Hq, Hkv, D): LLaMA-7B, SmolLM2-135M, the tiny test model.
HEADS = [(32, 32, 128), (9, 3, 64), (4, 2, 16)]
HIDDEN = [4096, 576]  # LLaMA-7B, SmolLM2
INTER = [11008, 1536]


def assert_near(out: torch.Tensor, ref: torch.Tensor, exact_share: float = 0.0, rtol: float = 2**-7) -> None:
    """Equal up to rounding: fp32 to 1e-4; bf16 within `rtol` and at least `exact_share` bit-equal."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-5)
        assert (out == ref).float().mean().item() >= exact_share
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warms `fn` up on a side stream (Triton compiles there), then captures one call in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("n", [1, 64, 333])
def test_rms_norm(dtype: torch.dtype, hidden: int, n: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, res, w = (rand(s, dtype, "cuda", gen) for s in ((n, hidden), (n, hidden), (hidden,)))
    out, res_out = kernels.rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res_out, ref_res)
    assert_near(out, ref_out, exact_share=0.95)
    assert_near(kernels.rms_norm(x, w, 1e-5)[0], reference.rms_norm(x, w, 1e-5)[0], exact_share=0.95)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_rotary_kv_write(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    case = rotary_case(n=64, hq=hq, hkv=hkv, d=d, s=8, lmax=512, dtype=dtype, device="cuda", seed=1)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    args = (case.q, case.k, case.v, case.cos, case.sin)
    q_rot = kernels.rotary_kv_write(*args, case.k_cache, case.v_cache, case.slots, case.positions)
    assert_near(q_rot, reference.rotary_kv_write(*args, k_ref, v_ref, case.slots, case.positions), 0.99)
    for cache, ref in ((case.k_cache, k_ref), (case.v_cache, v_ref)):
        assert torch.equal(cache.isnan(), ref.isnan())
        assert_near(cache.nan_to_num(), ref.nan_to_num(), exact_share=0.99)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("n", [1, 64])
def test_silu_mul(dtype: torch.dtype, inter: int, n: int) -> None:
    gate_up = rand((n, 2 * inter), dtype, "cuda", torch.Generator().manual_seed(2)) * 3
    assert_near(kernels.silu_mul(gate_up), reference.silu_mul(gate_up), exact_share=0.95)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_attention(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    long = 4096 if d == 128 else 2048
    # Split and merged (full, one, odd lengths), then a short cache in a single split.
    for lmax, lengths in ((long, [1, long, long - 993, 300, 64]), (200, [1, 200, 77])):
        c = attention_case(hq, hkv, d, lmax, lengths, dtype, "cuda", seed=3)
        out = kernels.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale)
        assert_near(out, reference.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale))


def test_graph_replay_rms_norm_and_silu_mul() -> None:
    gen = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    x, res, w = (rand(s, dt, "cuda", gen) for s in ((8, 4096), (8, 4096), (4096,)))
    gate_up = rand((8, 2 * 11008), dt, "cuda", gen)

    g1, (norm_out, res_out) = capture(lambda: kernels.rms_norm(x, w, 1e-5, residual=res))
    g2, act = capture(lambda: kernels.silu_mul(gate_up))
    for t in (x, res, w, gate_up):
        t.copy_(rand(tuple(t.shape), dt, "cuda", gen))
    for g in (g1, g2):
        g.replay()
    torch.cuda.synchronize()
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res_out, ref_res)
    assert_near(norm_out, ref_out, exact_share=0.95)
    assert_near(act, reference.silu_mul(gate_up), exact_share=0.95)


@pytest.mark.parametrize("heads", HEADS[:2])
def test_graph_replay_rotary_and_decode_attention(heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    dt = torch.bfloat16
    rot = rotary_case(n=8, hq=hq, hkv=hkv, d=d, s=8, lmax=1024, dtype=dt, device="cuda", seed=6)
    rot.k_cache.normal_()
    rot.v_cache.normal_()
    c = attention_case(hq, hkv, d, 1024, [5, 1024, 77, 300], dt, "cuda", seed=7)
    g1, q_rot = capture(
        lambda: kernels.rotary_kv_write(
            rot.q, rot.k, rot.v, rot.cos, rot.sin, rot.k_cache, rot.v_cache, rot.slots, rot.positions
        )
    )
    g2, attn = capture(lambda: kernels.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale))
    # New values in the same buffers: other tokens, cells and lengths.
    new = rotary_case(n=8, hq=hq, hkv=hkv, d=d, s=8, lmax=1024, dtype=dt, device="cuda", seed=8)
    names = ("q", "k", "v", "cos", "sin", "slots", "positions")
    for name in names:
        getattr(rot, name).copy_(getattr(new, name))
    k_ref, v_ref = rot.k_cache.clone(), rot.v_cache.clone()
    c2 = attention_case(hq, hkv, d, 1024, [1024, 1, 513, 64], dt, "cuda", seed=9)
    for name in ("q", "k_cache", "v_cache", "lengths"):
        getattr(c, name).copy_(getattr(c2, name))
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    ref_q = reference.rotary_kv_write(rot.q, rot.k, rot.v, rot.cos, rot.sin, k_ref, v_ref, rot.slots, rot.positions)
    assert_near(q_rot, ref_q, exact_share=0.99)
    assert_near(rot.k_cache, k_ref, exact_share=0.99)
    assert torch.equal(rot.v_cache, v_ref)
    assert_near(attn, reference.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale))
