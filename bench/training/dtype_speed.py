"""Which compute dtype is fastest here: fp32, bf16 weights, or fp32 weights with bf16 autocast.

Times, on SmolLM2 with a LoRA (r=8 on q, v), one training step (forward + backward) on a batch of
8 x 128 tokens and a greedy decode of 32 tokens at batch 8. Prints one JSON object with the times
and the speed-up of each dtype over fp32, measured in this same run.
Usage: python -m bench.training.dtype_speed [--model smollm2|tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adapters import LoraConfig, inject
from models import compute_context, load_base_model, tiny_llama
from models.settings import DTYPES


def median_time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for dtype in DTYPES:
        loaded = tiny_llama() if args.model == "tiny" else load_base_model(args.model, dtype=dtype)
        if args.model == "tiny" and dtype == "bfloat16":
            loaded.model.to(torch.bfloat16)
        adapted = inject(loaded.model)
        adapted.add_adapter("a", LoraConfig(dropout=0.0), seed=0)
        if dtype == "bfloat16":
            for p in adapted.parameters_of(["a"]):
                p.data = p.data.to(torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, int(loaded.model.config.vocab_size), (8, 128), generator=gen)

        def train_step(am=adapted, m=loaded.model, d=dtype, ids=ids) -> None:
            with compute_context(d), am.context.single("a", ids.shape[0]):
                loss = m(ids, labels=ids).loss
            loss.backward()

        def decode(am=adapted, m=loaded.model, d=dtype, ids=ids) -> None:
            with torch.inference_mode(), compute_context(d), am.context.single("a", 8, trainable=False):
                m.generate(ids[:, :16], max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           pad_token_id=0)

        step = median_time(train_step, args.repeats)
        dec = median_time(decode, args.repeats)
        results[dtype] = {"train_step_s": round(step, 3), "decode_tok_per_s": round(8 * 32 / dec, 1)}
    fp32 = results["float32"]
    for r in results.values():
        r["train_speedup_vs_fp32"] = round(fp32["train_step_s"] / r["train_step_s"], 2)
        r["decode_speedup_vs_fp32"] = round(r["decode_tok_per_s"] / fp32["decode_tok_per_s"], 2)
    best = min(results, key=lambda d: results[d]["train_step_s"])
    print(json.dumps({"benchmark": "bench.training.dtype_speed", "model": args.model,
                      "threads": torch.get_num_threads(), "results": results, "fastest_training": best}, indent=2))


if __name__ == "__main__":
    main()
