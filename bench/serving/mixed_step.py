"""Mixed steps: the running rows' decode in the prefill's forward (shipped) against two forwards.

A step that prefills new prompts while other requests decode used to run a prefill forward and then a
decode forward, reading every weight twice; it now runs one forward over both
(:meth:`serving.engine.executor.Executor.mixed`). Both are timed in one process on the bare base model, cases
interleaved round by round (the baseline patches ``Executor.fuses`` to refuse):
  1. ``--running`` greedy requests are prefilled and decode two steps;
  2. ``--arrivals`` new prompts (distinct chat-templated questions) arrive: the time until each has its
     first token (the mixed step, plus any steps the token budget adds) is the TTFT beside a running batch;
  3. the running requests then decode to ``--tokens`` tokens: the rest of the work, whose cost must not
     change.
Prints one JSON object: medians of both, and their ratios (< 1: the shipped step is faster).
Usage: python -m bench.serving.mixed_step [--running 32] [--arrivals 4] [--tokens 24] [--rounds 4]
"""

from __future__ import annotations

import itertools
import time

import torch

from bench.serving.common import apply_threads, interleave, median, parser, print_json, prompts, ratio
from models import load_base_model
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams


def main() -> None:
    p = parser(__doc__, rounds=4)
    p.add_argument("--running", type=int, default=32, help="requests decoding when the prompts arrive")
    p.add_argument("--arrivals", type=int, default=4, help="prompts arriving beside them")
    p.add_argument("--tokens", type=int, default=24, help="tokens each running request decodes")
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    # max_decode_skips 0: every step decodes (by default the step that starts new prompts leaves the decode
    # to the next step, and there would be no mixed forward to measure)
    engine = Engine(loaded, None, EngineConfig(max_batch_size=args.running + args.arrivals, max_model_len=512,
                                               max_decode_skips=0))
    shipped = engine.executor.fuses
    fresh = itertools.count()  # every prompt new: no case reuses another's cached prefix
    rest: dict[str, list[float]] = {"fused": [], "apart": []}

    def case(name: str) -> float:
        engine.executor.fuses = shipped if name == "fused" else (lambda prefill, decode: False)  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        first = SamplingParams(max_tokens=1, temperature=0)
        running = [engine.submit(GenerationRequest(prompt=q, sampling=params))
                   for q in prompts(loaded.tokenizer, args.running, next(fresh) * 1000)]
        engine.step()
        engine.step()
        t0 = time.perf_counter()
        new = [engine.submit(GenerationRequest(prompt=q, sampling=first))
               for q in prompts(loaded.tokenizer, args.arrivals, next(fresh) * 1000)]
        while not all(h.done for h in new):
            engine.step()
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        while engine.step():
            pass
        rest[name].append(time.perf_counter() - t1)
        if not all(h.result().finish_reason == "length" for h in running + new):
            raise RuntimeError("a request did not run to its length")
        return ttft

    with torch.inference_mode():
        case("fused")  # warm-up
        rest["fused"].clear()
        ttft = interleave({"fused": lambda: case("fused"), "apart": lambda: case("apart")}, args.rounds)
    ms = {name: median([v * 1000 for v in values], 1) for name, values in ttft.items()}
    rest_ms = {name: median([v * 1000 for v in values], 1) for name, values in rest.items()}
    print_json({
        "model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(), "rounds": args.rounds,
        "running": args.running, "arrivals": args.arrivals, "tokens": args.tokens,
        "ttft_ms_median": ms, "rest_ms_median": rest_ms,
        "ratio_ttft_fused_to_apart": ratio(ms["fused"], ms["apart"]),
        "ratio_rest_fused_to_apart": ratio(rest_ms["fused"], rest_ms["apart"]),
    })


if __name__ == "__main__":
    main()
