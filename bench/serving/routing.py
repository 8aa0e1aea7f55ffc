"""What FedDPA's instance-wise weighting (paper 000 section 4.3) adds to a request, on SmolLM2.

One ``<client>`` request at a time (batch 1) of a FedDPA-T-like run (:mod:`bench.serving.common`: 8
clients, 8 cached local instances each, S=5). Cases, interleaved round by round, medians reported:
  fixed           the run's fixed weight: one prefill, no routing
  instance        instance-wise weight: the prefill runs with the global adapter and also returns the
                  last-token state; faiss compares it with S cached instances; decode uses (1 - a, a)
                  (the serving default: the prompt's KV cache and first token come from the global adapter)
  instance_exact  the same with a second prefill under the routed weights (``exact_prefill``; the
                  batch evaluator's setting)
Each is timed twice: time to first token (``max_tokens=1``: prefill + routing + the first token) and
the whole request (``--tokens`` tokens, eos ignored). Then the same for a batch of 8 clients at once.
Prints one JSON object. Usage: python -m bench.serving.routing [--tokens 32] [--rounds 5] [--model smollm2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from bench.serving.common import build_run, interleave, median, prompts, timed
from models import load_base_model
from models.settings import DTYPES
from serving.engine import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.stack import Job, ServingStack, StackConfig, build_stack
from serving.targets import TargetResolver

CLIENTS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None, choices=DTYPES)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_base_model(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(loaded, Path(tmp), clients=CLIENTS)
        routed = build_stack(StackConfig(model=args.model, run_dir=run, engine=EngineConfig(max_batch_size=CLIENTS)),
                             loaded=loaded)
        assert routed.routing == "instance", routed.routing
        fixed = dataclasses.replace(routed, resolver=TargetResolver(routed.base_name, routed.pool, None,
                                                                    float(routed.info["alpha"])))
        texts = prompts(loaded.tokenizer, CLIENTS, 200)
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        whole = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        turn = {"i": 0}

        def one(stack: ServingStack, params: SamplingParams, exact: bool = False) -> float:
            c = turn["i"] % CLIENTS  # a different client and prompt each call
            turn["i"] += 1
            return timed(lambda: list(stack.run([Job(f"c{c}", params, texts[c], exact_prefill=exact)])))

        def batch(stack: ServingStack, exact: bool = False) -> float:
            jobs = [Job(f"c{c}", whole, texts[c], exact_prefill=exact) for c in range(CLIENTS)]
            return timed(lambda: list(stack.run(jobs)))

        one(routed, whole)  # warm-up
        cases = {
            "ttft_fixed": lambda: one(fixed, first), "ttft_instance": lambda: one(routed, first),
            "ttft_instance_exact": lambda: one(routed, first, True),
            "request_fixed": lambda: one(fixed, whole), "request_instance": lambda: one(routed, whole),
            "request_instance_exact": lambda: one(routed, whole, True),
            "batch8_fixed": lambda: batch(fixed), "batch8_instance": lambda: batch(routed),
            "batch8_instance_exact": lambda: batch(routed, True),
        }
        seconds = interleave(cases, args.rounds)
    ms = {k: round(1e3 * median(v), 2) for k, v in seconds.items()}
    print(json.dumps({
        "model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(), "clients": CLIENTS,
        "S": routed.config.feddpa.samples, "mode": routed.config.feddpa.mode, "tokens_per_request": args.tokens,
        "rounds": args.rounds, "ms_median": ms,
        "added_ms_ttft_instance": round(ms["ttft_instance"] - ms["ttft_fixed"], 2),
        "added_ms_ttft_instance_exact": round(ms["ttft_instance_exact"] - ms["ttft_fixed"], 2),
        "ratio_request_instance_to_fixed": round(ms["request_instance"] / ms["request_fixed"], 3),
        "ratio_request_instance_exact_to_fixed": round(ms["request_instance_exact"] / ms["request_fixed"], 3),
        "ratio_batch8_instance_to_fixed": round(ms["batch8_instance"] / ms["batch8_fixed"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
