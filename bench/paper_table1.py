"""Paper 000 Table 1 at a small budget: train each method on FedDPA dataset 1, evaluate, tabulate.

For every method in ``--methods`` this trains one run directory ``<out>/<method>`` with the in-process
simulator (a run already finished, i.e. with ``summary.json``, is reused; an interrupted one resumes
from its last complete round), evaluates it with the batch evaluator (``fedmosaic eval``: every client
on every task's test set, the global model and the bare base; predictions are cached, so an
interrupted evaluation resumes too), and puts the runs side by side in the layout of paper 000
Table 1 (Personalization block: each client on its own task; Test-Time Personalization block: each
client averaged over all tasks).

Each method trains with its own paper regime (:mod:`training.regime`) under ``--preset`` (``--rounds``
overrides the budget's rounds). With ``--seeds N`` every method is trained and evaluated N times (seeds
``--seed`` .. ``--seed + N - 1``, run directories ``<out>/<method>/seed<k>``) and every cell of both
blocks is reported as mean and standard deviation over the seeds (sample std, ``ddof=1``; 0 for one seed).

Prints one JSON object: the settings, per-method train/eval seconds, mean client loss per round, the
block averages per method, the per-cell mean/std, and the Markdown tables. Usage::

    python bench/paper_table1.py [--methods fedit,fedlora,feddpa-f,feddpa-t,fedoa,fedmcp]
        [--data feddpa1] [--rounds N] [--preset small] [--seeds 3] [--limit 5] [--max-new-tokens 32]
        [--metric rouge1] [--out runs/table1] [--model smollm2] [--option METHOD:KEY=VALUE ...]

``--option`` passes a method option to one method, e.g. ``--option pfedseq:warmup=1`` (pFedSeq's
paper warm-up is 10 rounds, longer than a small budget) or ``--option fedamole:top_k=2``.

The ``small`` preset (at most 6 local steps of at most 8 examples per round, cutoff 192, a tenth of the
paper's rounds) keeps one method well under an hour on a 2-core CPU; ``medium`` is a quarter of the
paper's rounds and 24 steps; ``paper`` is the paper's budget for a real machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from fedmosaic.evaluation.evaluate import EvalOptions, compare_runs, evaluate_run
from models import load_base_model
from training.cli import method_settings
from training.data import load_dataset
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
           options: dict[str, Any], seed: int) -> dict[str, Any]:
    summary = run_dir / "summary.json"
    if summary.is_file():
        return {**json.loads(summary.read_text()), "reused": True}
    eff = method_settings(method, args.preset, args.rounds, options)
    began = time.perf_counter()
    result = run_federated(method, dataset, loaded, run_dir, SimConfig(rounds=eff.rounds, seed=seed), eff.train,
                           eff.options, resume=(run_dir / "run.json").is_file(), data_spec=args.data,
                           model_name=args.model, preset_name=args.preset)
    return {"seconds": round(time.perf_counter() - began, 1), "losses": [round(x, 4) for x in result.losses],
            "rounds": eff.rounds, "bytes_up": result.bytes_up, "bytes_down": result.bytes_down,
            "failures": len(result.failures)}


def cell_stats(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and sample std over seeds of every cell of both blocks (``tables`` of each seed's results).

    Returns ``{block: {row label: {column: {"mean", "std"}, "avg": {"mean", "std"}}}}``; std is 0 for one seed.
    """

    def ms(values: list[float]) -> dict[str, float]:
        return {"mean": round(statistics.fmean(values), 4),
                "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0}

    out: dict[str, Any] = {}
    first = per_seed[0]["tables"]
    for block, rows in first.items():
        for i, row in enumerate(rows):
            seeds = [r["tables"][block][i] for r in per_seed]
            cells = {col: ms([float(s["values"][col]) for s in seeds]) for col in row["values"]}
            cells["avg"] = ms([float(s["avg"]) for s in seeds])
            out.setdefault(block, {})[row["label"]] = cells
    return out


def stats_markdown(stats: dict[str, dict[str, Any]], metric: str) -> str:
    """Both blocks of every method as ``mean ± std`` cells (the per-seed layout of paper 000 Table 1)."""
    title = {"personalization": "Personalization", "ttp": "Test-Time Personalization"}
    lines: list[str] = []
    for blocks in stats.values():
        for block, rows in blocks.items():
            for label, cells in rows.items():
                cols = [c for c in cells if c != "avg"]
                if not lines:
                    lines += ["| Block | Method | " + " | ".join(cols) + " | Avg |",
                              "|---|---|" + "---:|" * (len(cols) + 1)]
                values = " | ".join(f"{cells[c]['mean']:.2f} ± {cells[c]['std']:.2f}" for c in [*cols, "avg"])
                lines.append(f"| {title.get(block, block)} | {label} | {values} |")
    return f"{metric} x100, mean ± std over seeds\n\n" + "\n".join(lines) + "\n"


def _block_means(results: dict[str, Any]) -> dict[str, Any]:
    """Each Table-1 block's row averages of one evaluated run (label -> avg)."""
    return {block: {row["label"]: row["avg"] for row in rows} for block, rows in results["tables"].items()}


def main() -> None:
    """Train, evaluate and tabulate every requested method; print the JSON report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--data", default="feddpa1")
    p.add_argument("--rounds", type=int, default=None, help="default: each method's paper rounds under --preset")
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, default=1, help="train and evaluate every method with this many seeds")
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
    seeds = [args.seed + k for k in range(max(1, args.seeds))]
    stats: dict[str, Any] = {}
    for method in methods:
        per_seed, entry = [], {"train": [], "eval_seconds": [], "blocks": []}
        for seed in seeds:
            run_dir = out / method if len(seeds) == 1 else out / method / f"seed{seed}"
            if not (run_dir / "summary.json").is_file():
                loaded = loaded or load_base_model(args.model)
            # each run injects its own adapters: a fresh base model per training run keeps runs independent
            train = _train(method, run_dir, args, loaded, dataset, per_method.get(method, {}), seed)
            loaded = None
            began = time.perf_counter()
            results = evaluate_run(run_dir, EvalOptions(limit=args.limit, max_new_tokens=args.max_new_tokens,
                                                        metric=args.metric))
            entry["train"].append(train)
            entry["eval_seconds"].append(round(time.perf_counter() - began, 1))
            entry["blocks"].append(_block_means(results))
            per_seed.append(results)
        stats[method] = cell_stats(per_seed)
        report["methods"][method] = entry
    first = [out / m if len(seeds) == 1 else out / m / f"seed{seeds[0]}" for m in methods]
    report["table"] = compare_runs(first, out / "table1.md", args.metric)
    report["cells"] = stats
    report["table_mean_std"] = stats_markdown(stats, args.metric)
    (out / "table1_mean_std.md").write_text(report["table_mean_std"])
    print(json.dumps(report, indent=2))

if __name__ == "__main__":
    main()
