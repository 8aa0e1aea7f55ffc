"""Multi-LoRA overhead on SmolLM2: prefill and per-token decode, as ratios to the bare base model.

Batch 8 x 128 prompt tokens (issue 2 item 5). Cases, each measured in this same run:
  base        no adapter (zero weights)
  shared      one adapter for all rows (dense path)
  per_row     8 different adapters, one per row (gathered bmm path)
  mixed       FedDPA mixing: a shared global + each row's own local at (1 - a, a)
Prints one JSON object. Usage: python -m bench.serving.adapter_overhead [--model smollm2|tiny] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adapters import LoraConfig, inject
from models import load_base_model, tiny_llama
from models.settings import DTYPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None, choices=DTYPES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    loaded = tiny_llama() if args.model == "tiny" else load_base_model(args.model, dtype=args.dtype)
    model, batch = loaded.model, args.batch
    adapted = inject(model)
    names = ["global"] + [f"client{i}" for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    for i, name in enumerate(names):
        adapted.add_adapter(name, LoraConfig(r=8, alpha=16, dropout=0.0), seed=i)
        for _, layer in adapted.adapter_layers(name):
            b = layer.adapters[name].lora_B
            with torch.no_grad():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, vocab, (batch, args.tokens), generator=gen)
    eye = torch.eye(batch)
    cases = {
        "base": (["global"], torch.zeros(batch, 1)),
        "shared": (["global"], torch.ones(batch, 1)),
        "per_row": (names[1:], eye),
        "mixed": (names, torch.cat([torch.full((batch, 1), 0.5), 0.5 * eye], dim=1)),
    }

    def prefill(case: str):
        names_k, w = cases[case]
        with adapted.context.use(names_k, w):
            return model(ids, use_cache=True)

    def decode(case: str) -> float:
        """Return seconds per decode step (the prefill is run first and not counted)."""
        out = prefill(case)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        names_k, w = cases[case]
        with adapted.context.use(names_k, w):
            start = time.perf_counter()
            for _ in range(args.steps):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - start) / args.steps

    # Cases are interleaved round by round and medians taken, so a slow spell on this shared machine
    # hits every case alike instead of biasing one ratio.
    samples: dict[str, dict[str, list[float]]] = {c: {"prefill": [], "decode": []} for c in cases}
    with torch.inference_mode(), loaded.autocast():
        for case in cases:  # warm-up
            prefill(case)
            decode(case)
        for _ in range(args.repeats):
            for case in cases:
                start = time.perf_counter()
                prefill(case)
                samples[case]["prefill"].append(time.perf_counter() - start)
                samples[case]["decode"].append(decode(case))
    results: dict[str, dict[str, float]] = {
        c: {"prefill_s": round(statistics.median(v["prefill"]), 4),
            "decode_step_s": round(statistics.median(v["decode"]), 5)}
        for c, v in samples.items()
    }
    base = results["base"]
    for r in results.values():
        r["prefill_ratio"] = round(r["prefill_s"] / base["prefill_s"], 3)
        r["decode_ratio"] = round(r["decode_step_s"] / base["decode_step_s"], 3)
    print(json.dumps({
        "benchmark": "bench.serving.adapter_overhead", "model": loaded.name, "dtype": loaded.dtype,
        "batch": batch, "prompt_tokens": args.tokens, "decode_steps": args.steps,
        "threads": torch.get_num_threads(), "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
