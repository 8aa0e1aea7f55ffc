"""Whether the CPU matrix products are batch-invariant, and what the libraries' settings that make them so cost.

oneMKL (float32, the fused runner's in-feature-major matrices) and oneDNN (bf16, its packed copies) choose
kernels and thread splits by a product's row count. For each library setting below, a child process (the
settings are read when the library starts) takes SmolLM2's four matrix shapes of a decoder layer and
  1. counts, of 40 random sub-batches of rows per shape (2 to 600 rows at a random offset), those whose
     rows differ in any bit from the same rows inside one 600-row product;
  2. times one pass over the four matrices at 8, 64 and 512 rows (median of 7 runs of 5).
Settings: float32 as shipped, float32 with ``MKL_CBWR=AUTO,STRICT``, bf16 packed as shipped, bf16 packed with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (no AMX). Prints one JSON object (docs/serving.md, greedy
reproducibility).
Usage: python -m bench.serving.gemm_invariance [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

SHAPES = ((576, 1728), (576, 576), (576, 3072), (1536, 576))  # (in, out): q/k/v, o, gate/up, down
SETTINGS = {"float32": ("float32", {}), "float32_mkl_strict": ("float32", {"MKL_CBWR": "AUTO,STRICT"}),
            "bf16_packed": ("bf16", {}), "bf16_packed_no_amx": ("bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})}


def child(kind: str, threads: int) -> dict[str, object]:
    """Measure one setting in this process (its environment already set)."""
    import torch

    from serving.engine.runner.layout import linear, pack

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rnd = random.Random(0)
    mats = []
    for d_in, d_out in SHAPES:
        w = torch.randn(d_out, d_in) / 24
        mats.append((d_in, w.t().contiguous().t() if kind == "float32" else pack(w, torch.bfloat16)))
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    xs = {d_in: torch.randn(1200, d_in).to(dtype) for d_in, _ in SHAPES}
    differ = total = 0
    with torch.inference_mode():
        for d_in, w in mats:
            whole = linear(xs[d_in][:600], w, None)
            for _ in range(40):
                m = rnd.randint(2, 600)
                s = rnd.randint(0, 600 - m)
                total += 1
                differ += not torch.equal(linear(xs[d_in][s:s + m], w, None), whole[s:s + m])
        ms = {}
        for rows in (8, 64, 512):
            runs = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(5):
                    for d_in, w in mats:
                        linear(xs[d_in][:rows], w, None)
                runs.append((time.perf_counter() - t0) / 5 * 1e3)
            ms[str(rows)] = round(statistics.median(runs), 3)
    return {"sub_batches_differing": f"{differ}/{total}", "layer_ms_by_rows": ms}


def main(argv: list[str] | None = None) -> None:
    """Run each setting in a child process; print the JSON figures."""
    parser = argparse.ArgumentParser(description="Batch invariance of the CPU matrix products, per library setting.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child (default 2)")
    parser.add_argument("--child", nargs=1, choices=sorted({kind for kind, _ in SETTINGS.values()}),
                        help=argparse.SUPPRESS)  # one setting, in its own process (its environment already set)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.threads)))
        return
    out: dict[str, object] = {"threads": args.threads}
    for name, (kind, env) in SETTINGS.items():
        done = subprocess.run([sys.executable, "-m", "bench.serving.gemm_invariance", "--child", kind,
                               "--threads", str(args.threads)],
                              env={**os.environ, **env}, capture_output=True, text=True, check=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
