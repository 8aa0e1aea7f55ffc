"""``fedmosaic train``: arguments -> data set, base model, settings -> :func:`run_federated`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from models import settings


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def add_train_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic train``."""
    from training.algorithms import ALGORITHMS
    from training.runtime import PRESETS

    p = sub.add_parser("train", help="federated training in the in-process simulator")
    p.add_argument("--method", required=True, choices=sorted(ALGORITHMS))
    p.add_argument("--data", default="generated", help="feddpa1 | feddpa2 | dolly | generated | a folder")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", required=True, help="the run directory to write")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or a folder")
    p.add_argument("--preset", default="paper", choices=sorted(PRESETS), help="training budget preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fraction", type=float, default=1.0, help="share of clients per round")
    p.add_argument("--sample-rate", type=float, default=None, help="per-task client sampling (40-client study)")
    p.add_argument("--clients-per-task", type=int, default=1, help="split each task into k clients")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last round")
    p.add_argument("--timeout", type=float, default=None, help="soft per-client time limit in seconds")
    p.add_argument("--keep-strategy", type=int, default=1,
                   help="newest complete rounds that keep the strategy's resume tensors (0: every round)")
    p.add_argument("--dtype", choices=settings.DTYPES, default=None,
                   help="default: FEDMOSAIC_DTYPE, else bfloat16 on CUDA and autocast-bf16 on the CPU")
    p.add_argument("--device", type=settings.device_option, default=None, help=settings.DEVICE_HELP)
    for name, kind in (("lr", float), ("batch-size", int), ("micro-batch-size", int), ("local-epochs", int),
                       ("max-steps", int), ("cutoff-len", int)):
        p.add_argument(f"--{name}", type=kind, default=None, help="overrides the preset")
    p.add_argument("--n-train", type=int, default=None, help="generated suite: training examples per client")
    p.add_argument("--n-test", type=int, default=None, help="generated suite: test examples per task")
    p.add_argument("--families", default=None, help="generated suite: comma-separated task families")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, e.g. alpha=0.3, mu=0.01, lambda=0.5, weighting=num_examples")
    return p


def run_train(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic train``."""
    from models import load_base_model
    from training.data import load_dataset
    from training.runtime import preset
    from training.simulation import SimConfig, run_federated

    options: dict[str, Any] = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        options[key] = _value(value)
    data_options: dict[str, Any] = {}
    if args.data == "generated":
        for key in ("n_train", "n_test"):
            if getattr(args, key) is not None:
                data_options[key] = getattr(args, key)
        if args.families:
            data_options["families"] = args.families.split(",")
    dataset = load_dataset(args.data, **data_options)
    loaded = load_base_model(args.model, dtype=args.dtype, device=args.device)
    train = preset(args.preset, lr=args.lr, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                   local_epochs=args.local_epochs, max_steps=args.max_steps, cutoff_len=args.cutoff_len)
    sim = SimConfig(rounds=args.rounds, fraction=args.fraction, sample_rate=args.sample_rate, seed=args.seed,
                    client_timeout_s=args.timeout, keep_strategy=args.keep_strategy,
                    clients_per_task=args.clients_per_task)
    summary = run_federated(args.method, dataset, loaded, args.out, sim, train, options, resume=args.resume,
                            data_spec=args.data, data_options=data_options,
                            model_name=args.model)
    print(f"{summary.method}: {summary.rounds} rounds in {summary.seconds:.1f} s -> {summary.run_dir}")
    print("  mean client loss per round: " + ", ".join(f"{x:.3f}" for x in summary.losses))
    print(f"  bytes up {summary.bytes_up:,}  down {summary.bytes_down:,}  failures {len(summary.failures)}")
    return 0
