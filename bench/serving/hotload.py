"""Adapter hot-load costs of the adapter pool on SmolLM2, and the first request after a load.

PEFT folders of LoRA on q/v (every layer) at rank 8 (one client's local adapter) and 16 (a FedDPA
client exported at a fixed weight as one rank-concatenated adapter). Cases, interleaved, medians:
  load_r8 / load_r16   ``AdapterPool.load`` of a new name (read safetensors, validate, add to every layer)
  reload_r8            a reload under the same name (new version; the old one leaves the model)
  unload_r8            ``AdapterPool.unload``
  evicted_acquire_r8   leasing an adapter the LRU evicted (capacity 2): reloaded from its folder
  first_request_ms / warm_request_ms   one 8-token request right after a load vs on a warm adapter
Prints one JSON object (milliseconds). Usage: python -m bench.serving.hotload [--rounds 10] [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from adapters.export import export_mixture
from bench.serving.common import build_run, interleave, median, prompts, timed
from models import load_base_model
from models.settings import DTYPES
from serving.engine import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.stack import Job, StackConfig, build_stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None, choices=DTYPES)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_base_model(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(loaded, Path(tmp), clients=3)
        stack = build_stack(StackConfig(model=args.model, run_dir=run, max_loras=64,
                                        engine=EngineConfig(max_batch_size=1)), loaded=loaded)
        pool = stack.pool
        r8 = run / "adapters" / "clients" / "c0" / "local"
        lease = pool.acquire(("global", "c0:local"))
        r16 = export_mixture(stack.adapted, [(lease.names[0], 0.5), (lease.names[1], 0.5)], run / "exports" / "r16")
        lease.release()
        count = {"n": 0}

        def fresh(folder: Path) -> float:
            count["n"] += 1
            name = f"new{count['n']}"
            seconds = timed(lambda: pool.load(name, folder))
            pool.unload(name)
            return seconds

        def unload() -> float:
            count["n"] += 1
            name = f"gone{count['n']}"
            pool.load(name, r8)
            return timed(lambda: pool.unload(name))

        pool.load("hot", r8)
        cases = {"load_r8": lambda: fresh(r8), "load_r16": lambda: fresh(r16),
                 "reload_r8": lambda: timed(lambda: pool.load("hot", r8, replace=True)), "unload_r8": unload}
        seconds = interleave(cases, args.rounds)

        small = build_stack(StackConfig(model=args.model, dtype=args.dtype, run_dir=run, max_loras=2,
                                        engine=EngineConfig(max_batch_size=1)))  # a second copy of the model
        # 3 locals + global (pinned) in 2 slots: leasing the least recently used local reloads it
        names = ["c0:local", "c1:local", "c2:local"]
        turn = {"i": 0}

        def evicted() -> float:
            name = names[turn["i"] % 3]
            turn["i"] += 1
            assert not small.pool.info(name)[0].loaded, "expected an evicted adapter"
            return timed(lambda: small.pool.acquire([name]).release())

        for name in names[1:]:
            small.pool.acquire([name]).release()  # c0 is now the least recently used and evicted
        evict = interleave({"evicted_acquire_r8": evicted}, args.rounds)

        text = prompts(loaded.tokenizer, 1, 300)[0]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

        def request(reload: bool) -> float:
            if reload:
                pool.load("hot", r8, replace=True)  # a new version: nothing of the old one is reused
            return timed(lambda: list(stack.run([Job("hot", params, text)])))

        first = interleave({"first_request": lambda: request(True), "warm_request": lambda: request(False)},
                           args.rounds)
    ms = {k: round(1e3 * median(v), 2) for k, v in {**seconds, **evict, **first}.items()}
    print(json.dumps({"model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(),
                      "rounds": args.rounds, "ms_median": ms,
                      "ratio_first_to_warm_request": round(ms["first_request"] / ms["warm_request"], 3)}, indent=2))


if __name__ == "__main__":
    main()
