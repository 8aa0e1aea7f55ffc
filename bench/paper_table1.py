"""Paper 000 Table 1 at a small budget: train each method on FedDPA dataset 1, evaluate, tabulate.

For every method in ``--methods`` this trains one run directory ``<out>/<method>`` with the in-process
simulator (a run already finished, i.e. with ``summary.json``, is reused; an interrupted one resumes
from its last complete round), evaluates it with the batch evaluator (``fedmosaic eval``: every client
on every task's test set, the global model and the bare base; predictions are cached, so an
interrupted evaluation resumes too), and puts the runs side by side in the layout of paper 000
Table 1 (Personalization block: each client on its own task; Test-Time Personalization block: each
client averaged over all tasks).

Prints one JSON object: the settings, per-method train/eval seconds, mean client loss per round, the
block averages per method, and the Markdown table. Usage::

    python bench/paper_table1.py [--methods fedit,fedlora,feddpa-f,feddpa-t,fedoa,fedmcp]
        [--data feddpa1] [--rounds 3] [--preset small] [--limit 5] [--max-new-tokens 32]
        [--metric rouge1] [--out runs/table1] [--model smollm2] [--option METHOD:KEY=VALUE ...]

``--option`` passes a method option to one method, e.g. ``--option pfedseq:warmup=1`` (pFedSeq's
paper warm-up is 10 rounds, longer than a small budget) or ``--option fedamole:top_k=2``.

The ``small`` preset (6 local steps of 8 examples per round, cutoff 192) keeps one method well under an
hour on a 2-core CPU; ``paper`` is the paper's budget for a real machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from fedmosaic.evaluation.evaluate import EvalOptions, compare_runs, evaluate_run
from models import load_base_model
from training.data import load_dataset
from training.runtime import preset
from training.simulation import SimConfig, run_federated

DEFAULT_METHODS = "fedit,fedlora,feddpa-f,feddpa-t,fedoa,fedmcp"


def _method_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["pfedseq:warmup=1", ...]`` -> ``{"pfedseq": {"warmup": 1}}`` (values parsed as JSON when they are)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        method, colon, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not colon or not eq or not method or not key:
            raise SystemExit(f"--option expects METHOD:KEY=VALUE, got {item!r}")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(method, {})[key] = parsed
    return out


def _train(method: str, run_dir: Path, args: argparse.Namespace, loaded: Any, dataset: Any,
           options: dict[str, Any]) -> dict[str, Any]:
    summary = run_dir / "summary.json"
    if summary.is_file():
        return {**json.loads(summary.read_text()), "reused": True}
    began = time.perf_counter()
    result = run_federated(method, dataset, loaded, run_dir, SimConfig(rounds=args.rounds, seed=args.seed),
                           preset(args.preset), options, resume=(run_dir / "run.json").is_file(),
                           data_spec=args.data, model_name=args.model)
    return {"seconds": round(time.perf_counter() - began, 1), "losses": [round(x, 4) for x in result.losses],
            "bytes_up": result.bytes_up, "bytes_down": result.bytes_down, "failures": len(result.failures)}


def _block_means(results: dict[str, Any]) -> dict[str, Any]:
    """Each Table-1 block's row averages of one evaluated run (label -> avg)."""
    return {block: {row["label"]: row["avg"] for row in rows} for block, rows in results["tables"].items()}


def main() -> None:
    """Train, evaluate and tabulate every requested method; print the JSON report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--data", default="feddpa1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=5, help="test examples per task in the evaluation")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--metric", default="rouge1")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="runs/table1")
    p.add_argument("--option", action="append", default=[], metavar="METHOD:KEY=VALUE")
    args = p.parse_args()
    per_method = _method_options(args.option)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = Path(args.out)
    dataset = load_dataset(args.data)
    report: dict[str, Any] = {"settings": vars(args), "methods": {}}
    loaded = None
    for method in methods:
        run_dir = out / method
        if not (run_dir / "summary.json").is_file():
            loaded = loaded or load_base_model(args.model)
        # each run injects its own adapters: a fresh base model per training run keeps runs independent
        train = _train(method, run_dir, args, loaded, dataset, per_method.get(method, {}))
        loaded = None
        began = time.perf_counter()
        results = evaluate_run(run_dir, EvalOptions(limit=args.limit, max_new_tokens=args.max_new_tokens,
                                                    metric=args.metric))
        report["methods"][method] = {"train": train, "eval_seconds": round(time.perf_counter() - began, 1),
                                     "blocks": _block_means(results)}
    report["table"] = compare_runs([out / m for m in methods], out / "table1.md", args.metric)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
