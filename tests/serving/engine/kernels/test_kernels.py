"""serving.engine.kernels on CPU: the reference equals HF's modules and naive loops; the Triton kernels (run by
Triton's interpreter) equal the reference, in float32 and bfloat16, at odd shapes.

Without a GPU the repository's conftest.py sets TRITON_INTERPRET=1 before anything imports triton (and
so does this module when run on its own); with a GPU the process keeps compiled Triton
(tests/gpu/test_kernels_cuda.py tests the kernels there) and the interpreter tests skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.llama.configuration_llama import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from serving.engine import kernels  # noqa: E402
from serving.engine.kernels import reference  # noqa: E402
from tests.serving.engine.kernels.kernel_inputs import AttentionCase, attention_case, rand, rotary_case  # noqa: E402

REPO = Path(__file__).resolve().parents[4]
DTYPES = [torch.float32, torch.bfloat16]
# (Hq, Hkv, D): the tiny test model (G=2), SmolLM2 (G=3), LLaMA-7B (G=1).
HEADS = [(4, 2, 16), (9, 3, 64), (4, 4, 128)]


@pytest.fixture()
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes serving.engine.kernels' CPU calls through the Triton interpreter, or skips with the reason."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton==3.6.0, Linux x86_64)")
    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")
    if not kernels.uses_triton(torch.zeros(1)):
        pytest.skip("Triton's interpreter is off in this process (a GPU is present: see tests/gpu)")


def assert_near(out: torch.Tensor, ref: torch.Tensor, exact_share: float = 0.0) -> None:
    """Equal up to float rounding: fp32 to ~1e-5; bf16 to one rounding step, at least `exact_share` of
    the elements bit-equal (the kernels round where the reference rounds; float32 sums in another order
    move a few bf16 results by one step)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)
        assert (out == ref).float().mean().item() >= exact_share
    else:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)


def assert_attention_near(out: torch.Tensor, ref: torch.Tensor, c: AttentionCase) -> None:
    """The Triton attention against the CPU reference: float32 as assert_near; bf16 within the rounding of the
    attention weights, which the CPU's SDPA rounds to bf16 before the weighted sum and the Triton kernel
    keeps in float32: |error| <= 2^-9 sum_i p_i |v_i| <= 2^-9 max|v| for the weights, plus one output
    rounding each (2^-9 |out|), so within 2^-7 of the largest valid value."""
    if out.dtype != torch.bfloat16:
        assert_near(out, ref)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape and torch.isfinite(out).all()
    rows = zip(c.slots.tolist(), c.lengths.tolist(), strict=True)
    vmax = max(c.v_cache[s, :, :n].abs().max().item() for s, n in rows)
    torch.testing.assert_close(out, ref, rtol=0.0, atol=2**-7 * vmax)


# --- the reference against Hugging Face and naive loops -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rms_norm_is_hf(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x, res = rand((5, 48), dtype, "cpu", gen), rand((5, 48), dtype, "cpu", gen)
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(rand((48,), dtype, "cpu", gen))
        out, res_out = reference.rms_norm(x, hf.weight, 1e-5)
        assert torch.equal(out, hf(x)) and res_out is x
        out, res_out = reference.rms_norm(x, hf.weight, 1e-5, residual=res)
        assert torch.equal(res_out, res + x) and torch.equal(out, hf(res + x))
        # Naive: one row at a time in float64, rounded where HF rounds.
        for n in range(5):
            s = (x[n] + res[n]).double()
            h = (s / torch.sqrt((s * s).mean() + 1e-5)).to(dtype)
            torch.testing.assert_close(out[n], (hf.weight.double() * h.double()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rotary_is_hf_and_writes_the_cells(dtype: torch.dtype) -> None:
    case = rotary_case(n=6, hq=4, hkv=2, d=16, s=3, lmax=5, dtype=dtype, device="cpu", seed=1)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cos, sin = LlamaRotaryEmbedding(config)(case.q, case.positions[None])  # (1, N, D) in dtype
    assert torch.equal(cos[0], case.cos) and torch.equal(sin[0], case.sin)
    q_rot = reference.rotary_kv_write(
        case.q, case.k, case.v, case.cos, case.sin, case.k_cache, case.v_cache, case.slots, case.positions
    )
    # HF's layout (B, H, T, D) with T = 1: each token is its own batch entry.
    q_hf, k_hf = apply_rotary_pos_emb(case.q[:, :, None], case.k[:, :, None], cos[0][:, None], sin[0][:, None])
    assert torch.equal(q_rot, q_hf[:, :, 0])
    for n, (slot, pos) in enumerate(zip(case.slots.tolist(), case.positions.tolist(), strict=True)):
        assert torch.equal(case.k_cache[slot, :, pos], k_hf[n, :, 0])
        assert torch.equal(case.v_cache[slot, :, pos], case.v[n])
    assert case.k_cache.isnan().sum() == case.k_cache.numel() - case.k.numel()  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_silu_mul_is_hf(dtype: torch.dtype) -> None:
    gate_up = rand((3, 2 * 40), dtype, "cpu", torch.Generator().manual_seed(2))
    assert torch.equal(reference.silu_mul(gate_up), ACT2FN["silu"](gate_up[:, :40]) * gate_up[:, 40:])


@pytest.mark.parametrize("heads", HEADS)
def test_reference_decode_attention_is_the_naive_loop(heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    c = attention_case(hq, hkv, d, lmax=20, lengths=[1, 20, 7], dtype=torch.float32, device="cpu", seed=3)
    out = reference.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale)
    for b, (slot, length) in enumerate(zip(c.slots.tolist(), c.lengths.tolist(), strict=True)):
        for h in range(hq):
            keys = c.k_cache[slot, h // (hq // hkv), :length]  # (L, D); query head h reads kv head h // G
            values = c.v_cache[slot, h // (hq // hkv), :length]
            probs = torch.softmax(keys @ c.q[b, h] * c.scale, dim=0)
            torch.testing.assert_close(out[b, h], probs @ values)


@pytest.mark.parametrize("lengths", [[1, 20, 7], [9, 9, 9]])
@pytest.mark.parametrize("placed", [[1, 2, 3], [3, 1, 5], [0, 6, 2], [7, 0, 4]])
def test_reference_attention_reads_slot_ranges_in_place_and_writes_nothing(lengths: list[int],
                                                                           placed: list[int]) -> None:
    """Consecutive slots (read as a view of the cache) and any other placement (gathered) give the naive
    loop's result, with stale cells in every other slot and past each row's length: large finite keys and
    huge finite values (the cache's contract: ``SlotKV.release`` zeroes NaN a past owner wrote)."""
    c = attention_case(9, 3, 16, lmax=20, lengths=lengths, dtype=torch.float32, device="cpu", seed=5)
    k_cache = torch.full((8, *c.k_cache.shape[1:]), 1e4)
    v_cache = torch.full((8, *c.v_cache.shape[1:]), 3e38)
    slots = torch.tensor(placed)
    valid = torch.arange(20)[None, None, :, None] < c.lengths[:, None, None, None]  # (B, 1, Lmax, 1)
    k_cache[slots] = torch.where(valid, c.k_cache[c.slots], -1e4)
    v_cache[slots] = torch.where(valid, c.v_cache[c.slots], -3e38)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = reference.decode_attention(c.q, k_cache, v_cache, slots, c.lengths, c.scale)
    k, v = c.k_cache, c.v_cache
    gathered = torch.stack([  # the naive loop, row by row and head by head
        torch.stack([torch.softmax(k[slot, h // 3, :n] @ c.q[b, h] * c.scale, dim=0) @ v[slot, h // 3, :n]
                     for h in range(9)])
        for b, (slot, n) in enumerate(zip(c.slots.tolist(), c.lengths.tolist(), strict=True))])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, gathered)
    starts = c.lengths - 1
    pre = reference.prefill_attention(c.q[:, None], k_cache, v_cache, slots, starts, c.lengths, c.scale)
    torch.testing.assert_close(pre[:, 0], gathered)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_reference_prefill_attention_is_the_naive_loop() -> None:
    hq, hkv, d, t = 9, 3, 16, 4
    starts, chunk_lengths = [0, 5, 2], [4, 1, 3]  # row 1 has one real token, then padding
    lengths = [s + n for s, n in zip(starts, chunk_lengths, strict=True)]
    c = attention_case(hq, hkv, d, lmax=12, lengths=lengths, dtype=torch.float32, device="cpu", seed=4, chunk=t)
    out = reference.prefill_attention(
        c.q, c.k_cache, c.v_cache, c.slots, torch.tensor(starts), c.lengths, c.scale
    )  # (B, T, Hq, D)
    assert torch.isfinite(out).all()  # padded queries too
    for b, slot in enumerate(c.slots.tolist()):
        for i in range(chunk_lengths[b]):
            for h in range(hq):
                seen = starts[b] + i + 1  # causal: positions [0, start + i]
                keys = c.k_cache[slot, h // (hq // hkv), :seen]
                probs = torch.softmax(keys @ c.q[b, i, h] * c.scale, dim=0)
                torch.testing.assert_close(out[b, i, h], probs @ c.v_cache[slot, h // (hq // hkv), :seen])


def test_cpu_without_the_flag_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.INTERPRET_ENV, raising=False)
    gate_up = rand((2, 8), torch.float32, "cpu", torch.Generator().manual_seed(6))
    assert not kernels.uses_triton(gate_up)
    assert torch.equal(kernels.silu_mul(gate_up), reference.silu_mul(gate_up))


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from serving.engine.kernels.triton_ops import round_to

    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        """float32 -> bfloat16 through round_to (the rounding every kernel uses)."""
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, round_to(x, tl.bfloat16).to(tl.bfloat16), mask=offs < n)


# --- the Triton kernels (interpreter) against the reference ----------------------------------------------------


def test_triton_round_to_is_torchs_bf16_cast(triton_path: None) -> None:
    # Random float32 bit patterns (normal numbers, both signs, every exponent), plus rounding ties.
    bits = torch.randint(0, 2**31 - 1, (1 << 14,), generator=torch.Generator().manual_seed(13), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x, torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3e38, -3.4e38, 0.0])])
    x = x[x.isfinite() & ((x.abs() >= torch.finfo(torch.float32).tiny) | (x == 0))].contiguous()
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=1 << (x.numel() - 1).bit_length())
    assert torch.equal(y, x.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 576])
def test_triton_rms_norm(triton_path: None, dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(7)
    x, res = rand((3, hidden), dtype, "cpu", gen), rand((3, hidden), dtype, "cpu", gen)
    w = rand((hidden,), dtype, "cpu", gen)
    out, res_out = kernels.rms_norm(x, w, 1e-6)
    assert res_out is x
    assert_near(out, reference.rms_norm(x, w, 1e-6)[0], exact_share=0.95)
    out, res_out = kernels.rms_norm(x, w, 1e-6, residual=res)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(res_out, ref_res)
    assert_near(out, ref_out, exact_share=0.95)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_triton_rotary_kv_write(triton_path: None, dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    case = rotary_case(n=5, hq=hq, hkv=hkv, d=d, s=3, lmax=4, dtype=dtype, device="cpu", seed=8)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    args = (case.q, case.k, case.v, case.cos, case.sin)
    q_rot = kernels.rotary_kv_write(*args, case.k_cache, case.v_cache, case.slots, case.positions)
    q_ref = reference.rotary_kv_write(*args, k_ref, v_ref, case.slots, case.positions)
    assert_near(q_rot, q_ref, exact_share=0.99)
    for cache, ref in ((case.k_cache, k_ref), (case.v_cache, v_ref)):
        assert torch.equal(cache.isnan(), ref.isnan())  # exactly the tokens' cells written
        assert cache.isnan().sum() == cache.numel() - case.k.numel()
        assert_near(cache.nan_to_num(), ref.nan_to_num(), exact_share=0.99)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1100])
def test_triton_silu_mul(triton_path: None, dtype: torch.dtype, inter: int) -> None:
    gate_up = rand((3, 2 * inter), dtype, "cpu", torch.Generator().manual_seed(9)) * 3
    assert_near(kernels.silu_mul(gate_up), reference.silu_mul(gate_up), exact_share=0.95)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_triton_decode_attention(triton_path: None, dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    c = attention_case(hq, hkv, d, lmax=70, lengths=[1, 70, 33], dtype=dtype, device="cpu", seed=10)
    ref = reference.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale)
    assert_attention_near(kernels.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale), ref, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_attention_split_and_merged(triton_path: None, dtype: torch.dtype) -> None:
    from serving.engine.kernels import triton_attention

    c = attention_case(9, 3, 16, lmax=90, lengths=[1, 90, 33, 64], dtype=dtype, device="cpu", seed=11)
    ref = reference.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale)
    assert triton_attention.split_plan(90, chunk=32) == (3, 32)
    out = triton_attention.decode_attention(c.q, c.k_cache, c.v_cache, c.slots, c.lengths, c.scale, chunk=32)
    assert_attention_near(out, ref, c)
    assert triton_attention.split_plan(4096) == (16, 256) and triton_attention.split_plan(65536) == (64, 1024)
    assert triton_attention.split_plan(70) == (1, 128) and triton_attention.split_plan(8) == (1, 16)


# --- the same kernels compiled for an H100 (no GPU needed) ------------------------------------------------------


def test_triton_kernels_compile_for_sm90_without_spills() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton==3.6.0, Linux x86_64)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.serving.engine.kernels.kernel_aot"]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)["kernels"]
    assert {k["kernel"] for k in report} == {
        "_rms_norm_kernel", "_rotary_kv_kernel", "_silu_mul_kernel", "_decode_split_kernel", "_decode_merge_kernel",
    }
    assert [k for k in report if k["local_bytes"] or k["registers"] > 128] == []  # no spills, 4+ CTAs per SM
