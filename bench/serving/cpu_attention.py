"""CPU decode attention of the engine: the shipped reference against its former formulation.

``serving.engine.kernels.reference.decode_attention`` (the CPU path) reads every row's cache up to the longest
row. It used to convert those rows to float32 and run batched matmuls, a masked softmax and a float32
weighted sum; it now hands the bf16 rows as they are to PyTorch's fused SDPA, a kv head's query heads
folded in as queries (the weights rounded to bf16 for the weighted sum, as HF's SDPA under autocast).
The former formulation is written out below as the baseline. Cases interleaved round by round, medians
reported:
  1. one layer at SmolLM2's geometry (9 query heads, 3 KV heads, dim 64, bf16 cache), ``--rows`` rows of
     60-160 cached positions in scattered slots: milliseconds of each, and each one's largest error
     against a float64 attention over the same bf16 cells;
  2. the continuous-batching engine decoding ``--rows`` FedDPA requests of ``--tokens`` tokens together
     (8 clients' ``<client>`` targets, the run of :mod:`bench.serving.common`), with the baseline patched
     in and as shipped: aggregate tokens/s.
Prints one JSON object with both and their ratios (> 1: the shipped code is faster).
Usage: python -m bench.serving.cpu_attention [--rows 48] [--tokens 32] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench.serving.common import (
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
from serving.engine.kernels import reference
from serving.engine.sampling import SamplingParams
from serving.stack import Job, StackConfig, build_stack

SHIPPED = reference.decode_attention
_MASKED = torch.finfo(torch.float32).min


def former(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The former CPU decode attention: rows gathered and converted to float32, batched matmuls."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        length = int(lengths.max())
        valid = torch.arange(length)[None, :] < lengths[:, None]  # (B, L)
        k = k_cache[:, :, :length].index_select(0, slots).float()  # (B, Hkv, L, D)
        v = v_cache[:, :, :length].index_select(0, slots).float()
        scores = torch.matmul(q.float().view(b, hkv, hq // hkv, d), k.transpose(-1, -2)) * scale  # (B, Hkv, G, L)
        probs = torch.softmax(scores.masked_fill_(~valid[:, None, None, :], _MASKED), dim=-1)
        return torch.matmul(probs, v).reshape(b, hq, d).to(q.dtype)


def truth(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
          lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 attention over the same cells, row by row: (B, Hq, D)."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = []
    for b, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        k = k_cache[slot, :, :n].double().repeat_interleave(hq // hkv, dim=0)  # (Hq, n, D)
        v = v_cache[slot, :, :n].double().repeat_interleave(hq // hkv, dim=0)
        probs = torch.softmax(torch.einsum("hd,hld->hl", q[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("hl,hld->hd", probs, v))
    return torch.stack(out)


def use_former(on: bool) -> None:
    """Patch the former formulation into the reference module (the dispatcher calls it there), or restore."""
    reference.decode_attention = former if on else SHIPPED  # type: ignore[assignment]


def layer_ms(rows: int, repeats: int = 20) -> dict[str, float]:
    """Milliseconds of one layer's decode attention, former and shipped, at SmolLM2's geometry."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, lmax = 9, 3, 64, 256
    k = torch.randn(rows + 1, hkv, lmax, d, generator=gen).bfloat16()
    v = torch.randn(rows + 1, hkv, lmax, d, generator=gen).bfloat16()
    slots = torch.randperm(rows, generator=gen)
    lengths = torch.randint(60, 160, (rows,), generator=gen)
    q = torch.randn(rows, hq, d, generator=gen).bfloat16()
    exact = truth(q, k, v, slots, lengths, d ** -0.5)
    out: dict[str, float] = {
        f"max_error_{name}": (fn(q, k, v, slots, lengths, d ** -0.5).double() - exact).abs().max().item()
        for name, fn in (("former", former), ("shipped", SHIPPED))}
    for name, fn in (("former", former), ("shipped", SHIPPED)):
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

        def engine(baseline: bool) -> float:
            use_former(baseline)
            try:
                return timed(lambda: run_all(stack, jobs))
            finally:
                use_former(False)

        seconds = interleave({"former": lambda: engine(True), "shipped": lambda: engine(False)}, args.rounds)
    tok = {k: args.rows * args.tokens / median(v) for k, v in seconds.items()}
    print_json({"model": args.model, "rows": args.rows, "tokens": args.tokens,
                "layer_decode_attention_ms": layer,
                "ratio_layer_former_to_shipped": ratio(layer["former"], layer["shipped"]),
                "engine_feddpa_tok_s": {k: round(v, 1) for k, v in tok.items()},
                "ratio_engine_shipped_to_former": ratio(tok["shipped"], tok["former"])})


if __name__ == "__main__":
    main()
