"""What prompt-prefix reuse (serving.engine.prefix_cache) saves on chat requests sharing a template, on SmolLM2.

Eight chat prompts (:func:`bench.serving.common.prompts`: the chat template with its system prompt, then
different questions), each sent alone to one fixed target (``--target``, default ``global``) with
``max_tokens=1`` (prefill and the first token), cases interleaved prompt by prompt:
  reuse     the engine's prefix cache on (the default, 4 spare slots)
  no_reuse  the same engine with lookups switched off (every prompt computed from its first token)
Both cases run on one engine, so they share its model and batch; the first prompt is a warm-up.
Prints one JSON object: median time to first token per case, their ratio, and the tokens reused.
Usage: python -m bench.serving.prefix_cache [--rounds 3] [--target global] [--model smollm2]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from bench.serving.common import apply_threads, build_run, interleave, median, parser, prompts, timed
from models import load_base_model
from serving.engine import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.stack import Job, StackConfig, build_stack

CLIENTS = 8


def main() -> None:
    """Build the run, interleave the two cases over the prompts, print the JSON figures."""
    p = parser(__doc__)
    p.add_argument("--target", default="global", help="a fixed target of the run (global, c0:local, the base)")
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(loaded, Path(tmp), clients=CLIENTS)
        stack = build_stack(StackConfig(model=args.model, run_dir=run, engine=EngineConfig(max_batch_size=CLIENTS)),
                            loaded=loaded)
        cache = stack.engine.prefixes
        lookup = cache.reuse
        texts = prompts(loaded.tokenizer, CLIENTS)
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        turn = {"i": 0}

        def ask(reuse: bool) -> float:
            text = texts[turn["i"] // 2 % CLIENTS]  # both cases see each prompt in turn
            turn["i"] += 1
            cache.reuse = lookup if reuse else (lambda *a: 0)  # type: ignore[method-assign]
            return timed(lambda: list(stack.run([Job(args.target, first, text)])))

        ask(True), ask(False)  # warm-up: the first prompt fills the cache
        seconds = interleave({"reuse": lambda: ask(True), "no_reuse": lambda: ask(False)}, args.rounds * CLIENTS)
        hits, reused = cache.hits, cache.reused_tokens
    lengths = [len(loaded.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    ms = {k: round(1e3 * median(v), 1) for k, v in seconds.items()}
    print(json.dumps({
        "model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(), "target": args.target,
        "prompt_tokens": lengths, "requests_per_case": len(seconds["reuse"]), "ttft_ms_median": ms,
        "ratio_ttft_reuse_to_no_reuse": round(ms["reuse"] / ms["no_reuse"], 3),
        "hits": hits, "reused_tokens_per_hit": round(reused / hits, 1) if hits else 0.0,
    }, indent=2))


if __name__ == "__main__":
    main()
