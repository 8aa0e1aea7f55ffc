"""Requests arriving while the engine steps: steps and time until their first token, per pool lock.

The adapter pool's views and leases of adapters already in the model take the pool's own state lock
(shipped); they used to take the engine's model lock, which the engine holds for a whole step, so a
request arriving mid-step waited for that step to resolve its target, and for another to lease
(the engine took the lock back in between). The baseline patches the former locking back in
(``pool.table.state = pool.lock``). In one process, for each case in turn:
  1. ``--running`` FedDPA requests (``<client>`` targets of :func:`bench.serving.common.build_run`) decode in
     the engine's own thread, as in ``fedmosaic serve``;
  2. ``--arrivals`` requests arrive one after another from a client thread, each at a random moment
     of a step (a seeded delay), through ``ServingStack.submit`` as the HTTP routes call it; each
     records the engine steps that began between its arrival and its first token, and the seconds.
Steps are counted by the engine's step observer: their number does not depend on this shared
machine's speed, the seconds do. Prints one JSON object with medians per case and their ratio.
Usage: python -m bench.serving.lease_wait [--running 16] [--arrivals 12] [--rounds 2]
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.serving.common import apply_threads, build_run, interleave, median, parser, print_json, prompts, ratio
from models import load_base_model
from serving.engine import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.stack import Job, ServingStack, StackConfig, build_stack


def main() -> None:
    p = parser(__doc__, rounds=2)
    p.add_argument("--running", type=int, default=16, help="requests decoding while the others arrive")
    p.add_argument("--arrivals", type=int, default=12, help="requests arriving one after another per case")
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(loaded, Path(tmp))
        stack = build_stack(StackConfig(model=args.model, run_dir=run,
                                        engine=EngineConfig(max_batch_size=args.running + 2)), loaded=loaded)
        steps = [0]
        stack.engine.step_observers.append(lambda _: steps.__setitem__(0, steps[0] + 1))
        shipped = stack.pool.table.state
        texts = iter(prompts(loaded.tokenizer, 2_000))
        waited: dict[str, list[int]] = {"state_lock": [], "model_lock": []}
        rng = random.Random(0)

        def case(name: str) -> float:
            stack.pool.table.state = shipped if name == "state_lock" else stack.pool.lock  # type: ignore[assignment]
            return arrive(stack, steps, waited[name], texts, rng, args.running, args.arrivals)

        stack.engine.start()
        try:
            case("state_lock")  # warm-up
            waited["state_lock"].clear()
            values = interleave({"state_lock": lambda: case("state_lock"), "model_lock": lambda: case("model_lock")},
                                args.rounds)
        finally:
            stack.engine.stop()
            stack.pool.table.state = shipped
    ms = {name: median([v * 1000 for v in vals], 1) for name, vals in values.items()}
    n_steps = {name: median([float(v) for v in vals], 1) for name, vals in waited.items()}
    print_json({
        "model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(), "rounds": args.rounds,
        "running": args.running, "arrivals": args.arrivals,
        "steps_to_first_token_median": n_steps, "ttft_ms_median_of_rounds": ms,
        "ratio_steps_state_to_model_lock": ratio(n_steps["state_lock"], n_steps["model_lock"]),
        "ratio_ttft_state_to_model_lock": ratio(ms["state_lock"], ms["model_lock"]),
    })


def arrive(stack: ServingStack, steps: list[int], waited: list[int], texts: Iterator[str], rng: random.Random,
           running: int, arrivals: int) -> float:
    """Run one case: the background batch, then the arrivals; returns the median seconds to a first token."""
    endless = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    background = [stack.submit(Job(f"c{i % 8}", endless, next(texts))).handle for i in range(running)]
    while stack.engine.stats().running < running or stack.engine.stats().waiting:
        time.sleep(0.01)
    seconds: list[float] = []
    try:
        for i in range(arrivals):
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment of a step
            start, t0 = steps[0], time.perf_counter()
            sub = stack.submit(Job(f"c{i % 8}", one, next(texts)))
            sub.handle.result(timeout=120)  # one token: done at the first
            seconds.append(time.perf_counter() - t0)
            waited.append(steps[0] - start)
            if sub.handle.result().completion_tokens != 1:
                raise RuntimeError(f"an arrival did not get its token: {sub.handle.result().error}")
    finally:
        for handle in background:
            handle.cancel()
        while stack.engine.has_work():
            time.sleep(0.01)
    return median(seconds)


if __name__ == "__main__":
    main()
