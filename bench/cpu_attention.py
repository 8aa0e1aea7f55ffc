"""CPU attention of the engine: per-row views (serving/kernels/cpu.py) against the padded reference gather.

Two measurements, cases interleaved round by round, medians reported:
  1. one layer's decode attention at SmolLM2's geometry (9 query heads, 3 KV heads, dim 64, bf16 cache)
     for ``--rows`` rows of 60-160 cached positions each: ``reference.decode_attention`` (gather every
     row up to the longest, fp32 copy, masks) against ``cpu.decode_attention``;
  2. the continuous-batching engine decoding ``--rows`` FedDPA requests of ``--tokens`` tokens
     together (8 clients' ``<client>`` targets, the run of :mod:`bench.serve_common`), once with the
     dispatcher's CPU attention replaced by the reference and once as shipped: aggregate tokens/s.
Prints one JSON object with both and their ratios (per-row / reference: > 1 means the shipped path is
faster).
Usage: python bench/cpu_attention.py [--rows 48] [--tokens 32] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from serve_common import (
    apply_threads,
    build_run,
    interleave,
    median,
    parser,
    print_json,
    prompts,
    ratio,
    run_all,
    timed,
)

from models import load_base_model
from serving.engine import EngineConfig
from serving.kernels import cpu, reference
from serving.sampling import SamplingParams
from serving.stack import Job, StackConfig, build_stack

SHIPPED = (cpu.decode_attention, cpu.prefill_attention)


def use_reference(on: bool) -> None:
    """Route the dispatcher's CPU attention to the reference (True) or back to the per-row path."""
    cpu.decode_attention, cpu.prefill_attention = (
        (reference.decode_attention, reference.prefill_attention) if on else SHIPPED)  # type: ignore[assignment]


def layer_ms(rows: int, repeats: int = 20) -> dict[str, float]:
    """Milliseconds of one layer's decode attention, reference and per-row, at SmolLM2's geometry."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, lmax = 9, 3, 64, 256
    k = torch.randn(rows + 1, hkv, lmax, d, generator=gen).bfloat16()
    v = torch.randn(rows + 1, hkv, lmax, d, generator=gen).bfloat16()
    slots = torch.randperm(rows, generator=gen)
    lengths = torch.randint(60, 160, (rows,), generator=gen)
    q = torch.randn(rows, hq, d, generator=gen).bfloat16()
    out = {}
    for name, fn in (("reference", reference.decode_attention), ("per_row", SHIPPED[0])):
        fn(q, k, v, slots, lengths, d ** -0.5)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(q, k, v, slots, lengths, d ** -0.5)
        out[name] = round(1e3 * (time.perf_counter() - t0) / repeats, 3)
    return out


def main() -> None:
    """Measure both, print the JSON figures."""
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=48, help="requests decoding together")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per request")
    args = p.parse_args()
    apply_threads(args)
    layer = layer_ms(args.rows)
    loaded = load_base_model(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(loaded, Path(tmp))
        stack = build_stack(StackConfig(model=args.model, run_dir=run,
                                        engine=EngineConfig(max_batch_size=args.rows)), loaded=loaded)
        texts = prompts(loaded.tokenizer, args.rows)
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        jobs = [Job(f"c{i % 8}", params, texts[i]) for i in range(args.rows)]
        run_all(stack, jobs[:2])  # warm-up

        def engine(reference_path: bool) -> float:
            use_reference(reference_path)
            try:
                return timed(lambda: run_all(stack, jobs))
            finally:
                use_reference(False)

        seconds = interleave({"reference": lambda: engine(True), "per_row": lambda: engine(False)}, args.rounds)
    tok = {k: args.rows * args.tokens / median(v) for k, v in seconds.items()}
    print_json({"model": args.model, "rows": args.rows, "tokens": args.tokens,
                "layer_decode_attention_ms": layer,
                "ratio_layer_reference_to_per_row": ratio(layer["reference"], layer["per_row"]),
                "engine_feddpa_tok_s": {k: round(v, 1) for k, v in tok.items()},
                "ratio_engine_per_row_to_reference": ratio(tok["per_row"], tok["reference"])})


if __name__ == "__main__":
    main()
