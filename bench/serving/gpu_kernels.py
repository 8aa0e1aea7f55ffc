"""serving.engine.kernels on a GPU: each Triton kernel against its PyTorch reference at decode sizes.

Sizes: LLaMA-7B (H 4096, I 11008, 32/32 heads, D 128) and SmolLM2-135M (H 576, I 1536, 9/3 heads, D 64)
in bfloat16, N = 1, 8, 64 rows; decode attention over rows of about 64, 512 and 2048 positions in a
cache of Lmax = 2048 (the reference reads all Lmax positions on CUDA, as it must to stay graph-capturable);
the multi-LoRA shrink with 8 adapters of rank 16 (LLaMA) or 8 (SmolLM2). Each call is captured 10 times
in a CUDA graph (as the decode step runs); a figure is the median over 20 replays, per call, in
microseconds. GB/s counts the bytes the op must move (inputs read, outputs written; for attention the
valid cache positions only), the same for both paths; `speedup` is reference time / Triton time, and
`max_abs_diff` compares the two outputs. Prints one JSON object.

Usage: python -m bench.serving.gpu_kernels [--smoke]
  --smoke: tiny sizes on CPU through Triton's interpreter (wall-clock, one call each), so the code path
  runs on a machine without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

# The repository root first on the path, so `serving` resolves to this checkout in any environment.

# name: (hidden, intermediate, query heads, kv heads, head dim)
MODELS = {
    "llama-7b": (4096, 11008, 32, 32, 128),
    "smollm2-135m": (576, 1536, 9, 3, 64),
}
SMOKE_MODELS = {"tiny": (64, 128, 4, 2, 16)}
ROWS, SMOKE_ROWS = (1, 8, 64), (1, 3)
LENGTHS, SMOKE_LENGTHS = (64, 512, 2048), (5, 40)
GRAPH_CALLS, REPLAYS = 10, 20


@dataclass
class Case:
    """One op at one size: the two callables (same inputs) and the bytes the op must move."""

    op: str
    model: str
    size: dict[str, int]
    triton_fn: Callable[[], Any]
    reference_fn: Callable[[], Any]
    nbytes: int


def time_cuda(fn: Callable[[], Any]) -> float:
    """Microseconds per call: GRAPH_CALLS calls in one CUDA graph, median over REPLAYS replays."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: Triton compiles, the allocator settles
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / GRAPH_CALLS)  # ms -> us per call
    del graph
    return statistics.median(samples)


def time_cpu(fn: Callable[[], Any]) -> float:
    """Microseconds of one call, wall clock (the --smoke path)."""
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e6


def first(out: Any) -> Any:
    """The main output of an op (rms_norm returns (out, residual))."""
    return out[0] if isinstance(out, tuple) else out


def build_cases(device: str, smoke: bool) -> list[Case]:
    """Inputs for every op and size, on `device`, in bfloat16 (the callables bind them now: partial)."""
    import torch

    from serving.engine import kernels
    from serving.engine.kernels import reference

    dt, el = torch.bfloat16, 2  # bytes per element
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dt)

    models = SMOKE_MODELS if smoke else MODELS
    rows_list, lengths_list = (SMOKE_ROWS, SMOKE_LENGTHS) if smoke else (ROWS, LENGTHS)
    lmax = max(lengths_list)
    cases: list[Case] = []
    for model, (hidden, inter, hq, hkv, d) in models.items():
        for n in rows_list:
            size = {"n": n}
            x, res, w = rand(n, hidden), rand(n, hidden), rand(hidden)
            cases.append(Case(
                "rms_norm+residual", model, size, partial(kernels.rms_norm, x, w, 1e-5, res),
                partial(reference.rms_norm, x, w, 1e-5, res), (4 * n * hidden + hidden) * el,
            ))
            gate_up = rand(n, 2 * inter)
            cases.append(Case(
                "silu_mul", model, size, partial(kernels.silu_mul, gate_up), partial(reference.silu_mul, gate_up),
                3 * n * inter * el,
            ))
            rot = (rand(n, hq, d), rand(n, hkv, d), rand(n, hkv, d), rand(n, d), rand(n, d))  # q, k, v, cos, sin
            k_mine, v_mine, k_ref, v_ref = (torch.zeros((n, hkv, 64, d), dtype=dt, device=device) for _ in range(4))
            slots = torch.arange(n, device=device)
            positions = (torch.arange(n, device=device) * 7) % 64
            cases.append(Case(
                "rotary_kv_write", model, size,
                partial(kernels.rotary_kv_write, *rot, k_mine, v_mine, slots, positions),
                partial(reference.rotary_kv_write, *rot, k_ref, v_ref, slots, positions),
                (2 * n * hq * d + 4 * n * hkv * d + 2 * n * d) * el + 2 * n * 8,
            ))
            k_cache, v_cache = rand(n, hkv, lmax, d), rand(n, hkv, lmax, d)  # row b in slot b
            for length in lengths_list:
                row_lengths = [max(1, length - (b * 37) % 61) for b in range(n)]  # about `length`, <= Lmax
                lens = torch.tensor(row_lengths, dtype=torch.int64, device=device)
                attn = (rand(n, hq, d), k_cache, v_cache, slots, lens, d**-0.5)
                cases.append(Case(
                    "decode_attention", model, {"n": n, "length": length, "lmax": lmax},
                    partial(kernels.decode_attention, *attn), partial(reference.decode_attention, *attn),
                    (2 * sum(row_lengths) * hkv * d + 2 * n * hq * d) * el,
                ))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU through Triton's interpreter")
    args = parser.parse_args()
    if args.smoke:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["FEDMOSAIC_TRITON_INTERPRET"] = "1"
    import torch
    import triton

    from serving.engine import kernels
    from serving.engine.kernels import triton_attention

    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    if not kernels.uses_triton(torch.zeros(1, device=device)):
        sys.exit("serving.engine.kernels does not run Triton here (is triton installed? TRITON_INTERPRET set on a "
                 "GPU?)")
    timer = time_cpu if args.smoke else time_cuda
    results = []
    for case in build_cases(device, args.smoke):
        with torch.inference_mode():
            diff = (first(case.triton_fn()).float() - first(case.reference_fn()).float()).abs().max().item()
            triton_us, reference_us = timer(case.triton_fn), timer(case.reference_fn)
        results.append({
            "op": case.op, "model": case.model, **case.size, "bytes": case.nbytes,
            "triton_us": round(triton_us, 2), "reference_us": round(reference_us, 2),
            "triton_gbps": round(case.nbytes / triton_us / 1e3, 1),
            "reference_gbps": round(case.nbytes / reference_us / 1e3, 1),
            "speedup": round(reference_us / triton_us, 2), "max_abs_diff": diff,
        })
    print(json.dumps({
        "benchmark": "bench.serving.gpu_kernels", "smoke": args.smoke,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16",
        "timing": "smoke: one call, wall clock" if args.smoke else
                  f"per call: {GRAPH_CALLS} calls in a CUDA graph, median of {REPLAYS} replays",
        "decode_splits_at_lmax": triton_attention.split_plan(max(SMOKE_LENGTHS if args.smoke else LENGTHS)),
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
