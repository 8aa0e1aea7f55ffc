"""What a training forward costs beyond its tokens, and which cost the micro-batch planner should charge.

``training.local.micro_batches`` splits an optimizer step into more, smaller forwards only where the padding
saved outweighs a forward's fixed cost, counted in padded tokens (``CPU_FORWARD_TOKENS`` on the CPU).
This measures both halves on the device:

* ``fit``: one training forward and backward (``training.local.lm_forward``, the global adapter trainable, half
  of each row labelled) at several (rows, length) shapes, and the least-squares line
  ``seconds = fixed + per_token x tokens``; ``fixed_in_tokens`` is the planner's constant for this device.
* ``plans``: the steps a client's local run draws on ``--data`` (the trainer's shuffle, ``--batch`` rows
  a step, at most ``--micro-batch`` a forward), planned at each ``--costs`` value and trained forward and
  backward, the costs interleaved step by step so a shared machine's drift hits them alike. Per cost:
  seconds, forwards, padded tokens, and the speed-up over the first cost.

Prints one JSON object. Usage: ``python -m bench.training.forward_cost [--model smollm2|tiny|FOLDER] [--device D]
[--dtype D] [--data feddpa1|generated] [--clients 8] [--steps 3] [--batch 8] [--micro-batch 8]
[--cutoff 192] [--costs 16,64] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np
import torch

from bench.training.plain_peft import sync
from models import LoadedModel, ModelError, load_base_model
from models.settings import DEVICE_HELP, DTYPES, device_option
from training.data import IGNORE, DataError, collate, generate_suite, load_dataset
from training.local.lm_forward import lm_forward
from training.local.micro_batches import CPU_FORWARD_TOKENS, plan_groups
from training.local.runtime import Runtime, preset
from training.local.train import step_draws

SHAPES = ((1, 16), (1, 32), (1, 64), (1, 128), (2, 64), (4, 64), (8, 64), (8, 128))


def _train(rt: Runtime, batch: dict[str, torch.Tensor]) -> None:
    with rt.adapted.context.uniform(("global",), [1.0], trainable=("global",)), rt.loaded.autocast():
        out = lm_forward(rt.model, batch)
        assert out.loss is not None
        out.loss.backward()


def _timed(rt: Runtime, batches: Sequence[dict[str, torch.Tensor]]) -> float:
    sync(rt.device)
    start = time.perf_counter()
    for batch in batches:
        _train(rt, batch)
    sync(rt.device)
    return time.perf_counter() - start


def fit(rt: Runtime, repeats: int = 3) -> dict[str, object]:
    """Seconds of one training forward and backward at each of :data:`SHAPES`, and their line."""
    gen = torch.Generator().manual_seed(0)
    points = []
    vocab = int(getattr(rt.model.config, "vocab_size", 1000))
    for rows, length in SHAPES:
        ids = torch.randint(3, min(1000, vocab), (rows, length), generator=gen)
        labels = ids.clone()
        labels[:, : length // 2] = IGNORE
        batch = {"input_ids": ids.to(rt.device), "attention_mask": torch.ones_like(ids).to(rt.device),
                 "labels": labels.to(rt.device)}
        _timed(rt, [batch])  # warm: first-call allocations and kernel choices
        points.append((rows * length, min(_timed(rt, [batch]) for _ in range(repeats))))
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points])
    (fixed, per_token), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)
    return {"seconds": {f"{r}x{t}": round(s, 4) for (r, t), (_, s) in zip(SHAPES, points, strict=True)},
            "fixed_s": round(float(fixed), 4), "per_token_s": round(float(per_token), 6),
            "fixed_in_tokens": round(float(fixed / per_token), 1)}


def plans(rt: Runtime, clients: Sequence, costs: Sequence[int], batch: int, micro: int, steps: int,
          seed: int) -> dict[str, dict[str, float]]:
    """Each cost's seconds, forwards and padded tokens over the clients' first ``steps`` steps."""
    pad = rt.tokenizer.pad_token_id
    totals = {c: {"seconds": 0.0, "forwards": 0, "padded_tokens": 0} for c in costs}
    k = 0
    for client in clients:
        examples = rt.examples(client)
        draws = step_draws(len(examples), batch, seed)  # the steps a local run draws, as the trainer draws them
        for step in ([examples[i] for i in next(draws)] for _ in range(steps)):
            order = list(costs) if k % 2 == 0 else list(reversed(costs))
            k += 1
            for cost in order:
                groups = plan_groups([len(e.input_ids) for e in step], micro, None, cost)
                batches = [collate([step[i] for i in g], pad_id=pad, device=rt.device) for g in groups]
                totals[cost]["seconds"] += _timed(rt, batches)
                totals[cost]["forwards"] += len(batches)
                totals[cost]["padded_tokens"] += sum(int(b["input_ids"].numel()) for b in batches)
    first = totals[costs[0]]["seconds"]
    return {str(c): {**v, "seconds": round(float(v["seconds"]), 2),
                     f"speedup_over_{costs[0]}": round(first / v["seconds"], 3)} for c, v in totals.items()}


def _costs(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--costs must be distinct integers >= 0, comma-separated, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model folder")
    parser.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the device's")
    parser.add_argument("--data", default="feddpa1", help="feddpa1 (default; FEDMOSAIC_DATA_DIR) or generated")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps a client")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--cutoff", type=int, default=192)
    parser.add_argument("--costs", type=_costs, default=[16, 64],
                        help="planner costs (padded tokens a forward) to compare, the first the baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    for name in ("clients", "steps", "batch", "micro_batch", "cutoff"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:  # the data first: a wrong name fails before the model loads
        generated = args.data == "generated"
        suite = generate_suite(seed=args.seed, n_train=64, n_test=1) if generated else load_dataset(args.data)
    except DataError as exc:
        parser.error(f"--data: {exc}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        loaded: LoadedModel = load_base_model(args.model, dtype=args.dtype, device=args.device)
    except ModelError as exc:
        parser.error(f"--model: {exc}")
    train = preset("small", batch_size=args.batch, micro_batch_size=args.micro_batch, cutoff_len=args.cutoff)
    rt = Runtime(loaded, train)
    rt.adapted.set_trainable(("global",))
    rt.model.train()
    clients = list(suite.clients[: args.clients])
    figures = {"benchmark": "bench.training.forward_cost", "model": args.model, "device": str(rt.device),
               "dtype": loaded.dtype, "threads": torch.get_num_threads(), "data": args.data, "clients": len(clients),
               "steps": args.steps, "batch": args.batch, "micro_batch": args.micro_batch, "cutoff": args.cutoff,
               "planner_cpu_forward_tokens": CPU_FORWARD_TOKENS, "fit": fit(rt),
               "plans": plans(rt, clients, args.costs, args.batch, args.micro_batch, args.steps, args.seed)}
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
