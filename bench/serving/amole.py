"""AMoLE serving cost per decode step on SmolLM2, and what recording expert usage adds to it.

Batch 8, prompt 128 tokens, then decode steps with the KV cache, through the same routing object the
serving engine builds (:func:`serving.engine.amole.batch_routing`) over an AMoLE model of 30 experts
(r = 8, q/v of every layer; 6 assigned per client and layer, top-2). Cases, measured in this run:
  base            no adapter
  lora_per_row    8 different LoRA adapters, one per row (the multi-LoRA reference)
  amole_1_client  every row the same AMoLE client (one routing group)
  amole_8_clients 8 rows of 8 different clients (8 groups)
  amole_8_recorded  the same with the expert-choice recorder on and the per-step tally the engine does
Prints one JSON object. Usage: python -m bench.serving.amole [--model smollm2|tiny] [--steps 16] [--device cuda]
(every tensor of the step is made on the model's device; tests/bench/serving/test_amole.py runs
:func:`measure` on a pretend GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adapters import LoraConfig, inject
from adapters.amole_io import save_amole
from adapters.amole_layer import add_amole_experts
from adapters.amole_union import ExpertRecorder
from models import LoadedModel, load_base_model, tiny_llama
from models.settings import DEVICE_HELP, DTYPES, device_option
from serving.engine.amole import batch_routing
from serving.pool import AdapterPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None, choices=DTYPES)
    parser.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--experts", type=int, default=30)
    args = parser.parse_args()
    loaded = tiny_llama(device=args.device or "cpu") if args.model == "tiny" else \
        load_base_model(args.model, dtype=args.dtype, device=args.device)
    print(json.dumps(measure(loaded, args.batch, args.tokens, args.steps, args.repeats, args.experts), indent=2))


def measure(loaded: LoadedModel, batch: int, tokens: int, steps: int, repeats: int, experts: int) -> dict[str, Any]:
    """Time every case's decode step on ``loaded`` (on its device); the benchmark's JSON object."""
    model = loaded.model
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    config = LoraConfig(r=8, alpha=16, dropout=0.0)
    tmp = Path(tempfile.mkdtemp(prefix="amole-bench-"))
    # Write an AMoLE folder from a scratch injection, then serve it through the pool as a server does.
    scratch = inject(model)
    add_amole_experts(scratch, experts, config, seed=0)
    for layer in scratch.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * 0.01)
    assignments = {f"c{i}": {p: sorted(torch.randperm(experts, generator=gen)[:6].tolist())
                             for p in scratch.layers} for i in range(batch)}
    save_amole(scratch, tmp / "amole", experts, assignments)
    scratch.remove()
    adapted = inject(model)
    pool = AdapterPool(adapted, root=tmp, max_loras=batch + 1)
    pool.load("amole", "amole", pinned=True)
    lora = [f"l{i}" for i in range(batch)]
    for i, name in enumerate(lora):
        adapted.add_adapter(name, config, seed=100 + i)
    one = [pool.acquire([f"c{i}"]).route for i in range(batch)]
    paths = tuple(adapted.layers)
    eye = torch.eye(batch, device=device)

    def lora_ctx():
        return adapted.context.use(lora, eye)

    def amole_ctx(routes, recorder=None):
        return adapted.context.route_tokens(batch_routing(routes, recorder))

    cases: dict[str, Callable[[], object]] = {
        "base": adapted.context.base,
        "lora_per_row": lora_ctx,
        "amole_1_client": lambda: amole_ctx([one[0]] * batch),
        "amole_8_clients": lambda: amole_ctx(one),
        "amole_8_recorded": lambda: None,  # built per step below
    }
    vocab = int(model.config.vocab_size)
    # drawn on the CPU (a seed means the same everywhere), then moved: made there, it failed on CUDA (issue 46)
    ids = torch.randint(3, vocab, (batch, tokens), generator=gen).to(device)

    def step(case: str, nxt: torch.Tensor, past: object) -> object:
        if case != "amole_8_recorded":
            with cases[case]():  # type: ignore[attr-defined]
                return model(nxt, past_key_values=past, use_cache=True)
        recorder = ExpertRecorder()
        with amole_ctx(one, recorder):
            out = model(nxt, past_key_values=past, use_cache=True)
        recorder.counts(paths, experts, batch)  # the engine's per-step tally
        return out

    def decode(case: str) -> float:
        with cases["base" if case == "amole_8_recorded" else case]():  # type: ignore[attr-defined]
            out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            out = step(case, nxt, past)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)  # type: ignore[attr-defined]
        _sync(device)
        return (time.perf_counter() - start) / steps

    # Interleaved rounds and medians: a slow spell on this shared machine hits every case alike.
    samples: dict[str, list[float]] = {c: [] for c in cases}
    with torch.inference_mode(), loaded.autocast():
        for case in cases:
            decode(case)  # warm-up
        for _ in range(repeats):
            for case in cases:
                samples[case].append(decode(case))
    base = statistics.median(samples["base"])
    results = {c: {"decode_step_s": round(statistics.median(v), 5),
                   "ratio_to_base": round(statistics.median(v) / base, 3)} for c, v in samples.items()}
    recorded, plain = statistics.median(samples["amole_8_recorded"]), statistics.median(samples["amole_8_clients"])
    return {
        "benchmark": "bench.serving.amole", "model": loaded.name, "dtype": loaded.dtype, "device": str(device),
        "batch": batch, "prompt_tokens": tokens, "decode_steps": steps, "experts": experts, "assigned": 6,
        "top_k": 2, "threads": torch.get_num_threads(), "results": results,
        "recorder_overhead": round(recorded / plain - 1.0, 4),
    }


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: a timer must not stop before it)."""
    if device.type == "cuda" and torch.cuda.is_available():  # not the CPU-side device check's pretend GPU
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
