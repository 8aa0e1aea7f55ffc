"""Paper 000 Table 1 for reproduction: train, evaluate every test example, tabulate mean ± std over seeds.

A *cell* is one method x seed x weighting rule. For each, this trains the run directory
``<out>/<method>/seed<k>`` with the in-process simulator under ``--preset`` (a finished run, with
``summary.json``, is reused; an interrupted one resumes from its last complete round), evaluates it with
the batch evaluator (``fedmosaic eval``: every client on every task's test set, the global and the bare
base model; all test examples unless ``--limit``; predictions cached per decoding setting) and writes
``<out>/cells/<method>__seed<k>__<rule>.json`` atomically. A cell whose file exists is skipped, so the
table can be built over several sessions: run the same command again.

FedLoRA and FedDPA-F train exactly FedIT's rounds: with FedIT's run of the seed finished, theirs start from
a copy of its round checkpoints and compute only their end (``bench/table_runs.py``; the cell says
``rounds_from`` and its training seconds include the rounds').

FedDPA-F and FedDPA-T get two cells per seed from one training run: the paper's instance-wise rule
(``paper``, paper 000 section 4.3: the paper's columns) and ``calibrated`` (our extension,
``routing/calibration.py``, its constants chosen per client on a validation split of its training
prompts); every other method is evaluated as it serves (``native``). FedOA runs with ``--leave-out``
(paper 001's leave-one-task-out protocol) when given.

Outputs: ``<out>/table1.md`` (ready to paste into the README: the summary with Personalization and
TTP, paper 000 section 5.2, as mean ± sample std over the seeds, per-task blocks, per-cell training and
evaluation seconds) and ``<out>/table1.json``; the JSON report is printed too. Usage::

    python bench/paper_table1.py [--methods fedit,fedlora,feddpa-f,feddpa-t,local] [--seeds 0 1 2]
        [--preset repro] [--data feddpa1|generated] [--num-beams 4] [--max-new-tokens 80] [--limit N] [--ttp-limit N]
        [--leave-out TASKS] [--rounds N] [--option METHOD:KEY=VALUE] [--out runs/table1] [--model smollm2]

``--preset`` defaults to ``repro`` when training has it, else ``small`` (said in the report); any preset
training accepts is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from adapters.rundir import RunDir
from fedmosaic.evaluation.evaluate import EvalOptions, evaluate_run, output_dir
from fedmosaic.evaluation.predictions import PredictionCache
from training.algorithms import ALGORITHMS
from training.cli import method_settings
from training.regime import BUDGETS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when loaded from a file

import table_orderings  # noqa: E402
import table_runs  # noqa: E402
from table_runs import check_training_settings, write_json  # noqa: E402

LABELS = {"fedit": "FedIT", "fedlora": "FedLoRA", "feddpa-f": "FedDPA-F", "feddpa-t": "FedDPA-T", "local": "Local",
          "fedoa": "FedOA", "fedmcp": "FedMCP", "fedamole": "FedAMoLE", "pfedseq": "pFedSeq",
          "centralized": "Centralized"}
DEFAULT_METHODS = "fedit,fedlora,feddpa-f,feddpa-t,local"
RULES = {"feddpa-f": ("paper", "calibrated"), "feddpa-t": ("paper", "calibrated")}  # others: ("native",)
BLOCKS = {"personalization": "Personalization", "ttp": "TTP"}


def default_preset() -> tuple[str, str | None]:
    """``repro`` when training defines it, else ``small`` with a note saying so."""
    if "repro" in BUDGETS:
        return "repro", None
    return "small", "training has no 'repro' preset yet: fell back to 'small'"


def method_options(items: list[str]) -> dict[str, dict[str, Any]]:
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


def cell_path(out: Path, method: str, seed: int, rule: str, args: argparse.Namespace) -> Path:
    """Where one cell's result lives: its name says the evaluation setting, so settings never share a cell."""
    setting = f"{args.metric}-{'all' if args.limit is None else args.limit}-b{args.num_beams}-t{args.max_new_tokens}"
    if args.ttp_limit is not None:
        setting += f"-ttp{args.ttp_limit}"
    if method == "fedoa" and args.leave_out:  # trained without those tasks: another run, another cell
        setting += "-lo-" + "+".join(t for t in args.leave_out.split(",") if t)
    return out / "cells" / f"{method}__seed{seed}__{rule}__{setting}.json"


def eval_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The evaluation settings a cell records and is matched on (``ttp_limit`` only when given)."""
    found: dict[str, Any] = {"limit": args.limit, "num_beams": args.num_beams, "max_new_tokens": args.max_new_tokens}
    if args.ttp_limit is not None:
        found["ttp_limit"] = args.ttp_limit
    return found


def share_base_answers(run_dir: Path, shared: Path, *, into_run: bool) -> int:
    """Copy the bare base model's cached answers between one run and ``shared`` (``<out>/base-answers``).

    The base model (no adapter) answers the same prompts the same way in every run, so the table
    generates them once, not once per cell: before a run is evaluated its cache receives the shared
    answers it lacks (``into_run``), and afterwards the shared folder receives the run's. The cache
    checks each row's prompt and generation tag, so answers of other settings are never used.

    Returns:
        The number of task files copied.
    """
    cache = PredictionCache(output_dir(RunDir(run_dir)) / "predictions")
    run_base = cache.path("final", "base", "x").parent
    src, dst = (shared, run_base) if into_run else (run_base, shared)
    copied = 0
    for path in sorted(src.glob("*.jsonl")) if src.is_dir() else []:
        target = dst / path.name
        if not target.is_file():
            dst.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".tmp-{target.name}.part")  # not *.jsonl: never read as a task file
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
            copied += 1
    return copied


def run_cell(method: str, seed: int, rule: str, args: argparse.Namespace, train: dict[str, Any]) -> dict[str, Any]:
    """Evaluate one cell (the run is trained) and return its JSON record."""
    run_dir = Path(args.out) / method / f"seed{seed}"
    opts = EvalOptions(limit=args.limit, ttp_limit=args.ttp_limit, max_new_tokens=args.max_new_tokens,
                       num_beams=args.num_beams,
                       batch_size=args.batch_size, metric=args.metric, dtype=args.dtype, device=args.device,
                       feddpa_weighting=None if rule == "native" else rule)
    shared = Path(args.out) / "base-answers"
    share_base_answers(run_dir, shared, into_run=True)
    began = time.perf_counter()
    summary = evaluate_run(run_dir, opts)
    share_base_answers(run_dir, shared, into_run=False)
    cell: dict[str, Any] = {"method": method, "label": LABELS.get(method, method), "seed": seed, "rule": rule,
                            "preset": args.preset, "data": args.data, "metric": args.metric,
                            "eval": eval_settings(args),
                            "train_seconds": train.get("train_seconds"), "losses": train.get("losses"),
                            "eval_seconds": round(time.perf_counter() - began, 1),
                            "n_per_task": summary["test_set"]["tasks"]}
    if "answers" in summary:  # eval_seconds paid for the generated ones; the cached came from an earlier call
        cell["answers"] = summary["answers"]
    cell["loss_curves"] = table_runs.loss_curves(run_dir)
    weights = summary.get("feddpa_weights") or {}
    if "own_client" in weights:  # the run's results.json keeps only its last rule's: the cell keeps its own
        cell["local_weight"] = {"own_task": weights["own_client"]["mean"],
                                "other_tasks": weights["other_clients"]["mean"]}
    if train.get("rounds_from"):  # its rounds are another run's (table_runs.ROUNDS_OF); seconds include theirs
        cell["rounds_from"] = train["rounds_from"]
    for block, rows in summary["tables"].items():
        own = rows[0]  # the method's personalised models; the [global] and [base] rows follow
        cell[block] = {"values": own["values"], "avg": own["avg"]}
        glob = next((r for r in rows if r["label"].endswith("[global]")), None)
        if glob is not None:
            cell.setdefault("global", {})[block] = glob["avg"]
        bare = next((r for r in rows if r["label"].endswith("[base]")), None)
        if bare is not None:
            cell.setdefault("base", {})[block] = bare["avg"]
    if "ood" in summary:
        cell["ood"] = summary["ood"]
    cell["examples"] = summary.get("example_scores")  # main keeps them apart: <out>/examples/<cell file>
    return cell


def matching_cells(out: Path, have: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Finished cells of ``out`` that this invocation did not ask for but that share its settings.

    The table is built over several invocations (three seeds for some methods, one for others): each
    ``table1.md`` lists every cell made with the same data, preset, metric and evaluation.
    """
    seen = {(c["method"], c["seed"], c["rule"]) for c in have}
    want = {"preset": args.preset, "data": args.data, "metric": args.metric,
            "eval": eval_settings(args)}
    extra = []
    for path in sorted((out / "cells").glob("*.json")):
        cell = json.loads(path.read_text())
        if (cell["method"], cell["seed"], cell["rule"]) not in seen and all(cell.get(k) == v for k, v in want.items()):
            extra.append(cell)
    order = {m: i for i, m in enumerate(LABELS)}
    return sorted(extra, key=lambda c: (order.get(c["method"], len(order)), c["rule"], c["seed"]))


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (``ddof=1``; 0 for one value)."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def aggregate(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, rule), in the cells' order: mean ± std over seeds of every block's cells and average."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["method"], cell["rule"]), []).append(cell)
    rows = []
    for (method, rule), group in groups.items():
        row: dict[str, Any] = {"method": method, "label": group[0]["label"], "rule": rule,
                               "seeds": [c["seed"] for c in group]}
        for block in BLOCKS:
            present = [c[block] for c in group if block in c]
            if not present:
                continue
            columns = list(present[0]["values"])
            row[block] = {"avg": mean_std([float(p["avg"]) for p in present]),
                          "values": {col: mean_std([float(p["values"][col]) for p in present
                                                    if p["values"].get(col) is not None])
                                     for col in columns if any(p["values"].get(col) is not None for p in present)}}
        row["train_seconds"] = mean_std([float(c["train_seconds"]) for c in group if c.get("train_seconds") is not None]
                                        or [float("nan")])
        row["eval_seconds"] = mean_std([float(c["eval_seconds"]) for c in group])
        rows.append(row)
    return rows


def _pm(stat: dict[str, float] | None) -> str:
    if stat is None:
        return "–"
    # one seed has no spread to show: "± 0.00" would claim one
    return f"{stat['mean']:.2f}" if stat.get("n", 2) < 2 else f"{stat['mean']:.2f} ± {stat['std']:.2f}"


def _name(row: dict[str, Any]) -> str:
    return row["label"] + {"paper": " (paper rule)", "calibrated": " (calibrated, ours)"}.get(row["rule"], "")


def markdown(rows: list[dict[str, Any]], cells: list[dict[str, Any]], settings: dict[str, Any],
             orderings: list[dict[str, Any]] | None = None) -> str:
    """The README-ready Markdown: the summary, per-task blocks, per-cell times and the orderings' paired tests."""
    lines = [f"Data {settings['data']}, preset {settings['preset']}, {settings['metric']} x100, "
             f"{settings['evaluation']}; mean ± sample std over the seeds listed.", "",
             "| Method | Seeds | Personalization | TTP | Train s / run | Eval s / cell |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        pers, ttp = (r.get("personalization") or {}).get("avg"), (r.get("ttp") or {}).get("avg")
        lines.append(f"| {_name(r)} | {','.join(map(str, r['seeds']))} | {_pm(pers)} | {_pm(ttp)} | "
                     f"{r['train_seconds']['mean']:.0f} | {r['eval_seconds']['mean']:.0f} |")
    for block in BLOCKS:
        columns = list(dict.fromkeys(c for r in rows for c in (r.get(block) or {}).get("values", {})))
        if not columns:
            continue
        caption = {"personalization": "Personalization per client (its model on its own task; columns name "
                                      "the client's task):",
                   "ttp": "TTP per client (its model's mean over every task; columns name the client's task):"}[block]
        lines += ["", caption, "", "| Method | " + " | ".join(columns) + " | Avg |",
                  "|---|" + "---:|" * (len(columns) + 1)]
        for r in rows:
            if block in r:
                vals = [_pm(r[block]["values"].get(c)) for c in columns]
                lines.append(f"| {_name(r)} | " + " | ".join(vals) + f" | {_pm(r[block]['avg'])} |")
    lines += ["", "Per cell (training seconds are per run, shared by a run's two weighting rules; the run's "
              "global adapter alone beside its personalised models):", "",
              "| Method | Rule | Seed | Train s | Eval s | Answers made | Personalization | TTP | Global: Pers. "
              "| Global: TTP |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        glob = c.get("global") or {}
        figures = [(c.get("personalization") or {}).get("avg"), (c.get("ttp") or {}).get("avg"),
                   glob.get("personalization"), glob.get("ttp")]
        made = (c.get("answers") or {}).get("generated", "–")
        mark = "*" if c.get("eval_note") else ""
        shown = " | ".join("–" if v is None else f"{float(v):.2f}" for v in figures)
        lines.append(f"| {c['label']} | {c['rule']} | {c['seed']} | {c.get('train_seconds')} | "
                     f"{c['eval_seconds']}{mark} | {made} | {shown} |")
    notes = [c for c in cells if c.get("eval_note")]
    if notes or any("answers" in c for c in cells):
        lines += ["", "\"Answers made\" counts the answers a cell's evaluation generated (its Eval s; – where the "
                  "cell predates the count); the rest it scored were cached (the shared base answers, or an "
                  "interrupted evaluation's)." + (" Eval s marked \\* has a note:" if notes else "")]
    if notes:
        lines += [""] + [f"- {c['label']} {c['rule']} seed {c['seed']}: {c['eval_note']}." for c in notes]
    lines += table_orderings.ordering_lines(orderings or [], LABELS)
    lines += table_runs.ood_lines(cells)
    lines += table_runs.loss_lines(cells)
    lines += table_runs.base_lines(cells)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated: " + ",".join(LABELS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--preset", default=None, help="a training preset (default: repro, else small)")
    p.add_argument("--data", default="feddpa1", help="feddpa1 | generated (any spec training accepts)")
    p.add_argument("--data-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a loader option, e.g. n_train=4 for the generated suite")
    p.add_argument("--leave-out", default=None, metavar="TASKS", help="FedOA's held-out tasks (paper 001 protocol)")
    p.add_argument("--rounds", type=int, default=None, help="default: each method's rounds under --preset")
    p.add_argument("--limit", type=int, default=None, help="test examples per task (default: all)")
    p.add_argument("--ttp-limit", type=int, default=None, metavar="N",
                   help="a client's model on the other tasks (the TTP column only): the first N examples of each")
    p.add_argument("--num-beams", type=int, default=1, help="the FedDPA reference: 4")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the FedDPA reference: 80")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--metric", default="rouge1")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="runs/table1")
    p.add_argument("--option", action="append", default=[], metavar="METHOD:KEY=VALUE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every missing cell, then tabulate all requested cells; returns (and prints) the JSON report."""
    args = parse_args(argv)
    if args.leave_out is not None and not [t for t in args.leave_out.split(",") if t.strip()]:
        raise SystemExit(f"paper_table1: --leave-out needs task names, got {args.leave_out!r}")
    note = None
    if args.preset is None:
        args.preset, note = default_preset()
    methods = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"paper_table1: unknown methods {unknown}; known: {sorted(ALGORITHMS)}")
    try:
        method_settings(methods[0], args.preset, args.rounds)
    except ValueError as exc:  # an unknown preset names the known ones
        raise SystemExit(f"paper_table1: {exc}") from exc
    base_options: dict[str, Any] = {}
    for item in args.data_option:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--data-option expects KEY=VALUE, got {item!r}")
        try:
            base_options[key] = json.loads(value)
        except json.JSONDecodeError:
            base_options[key] = value.split(",") if "," in value else value
    per_method = method_options(args.option)
    out = Path(args.out)
    check_training_settings(out, args)
    cells, done, failed = [], [], []
    for method in methods:
        data_options = dict(base_options)
        if method == "fedoa" and args.leave_out:
            data_options["leave_out"] = [t for t in args.leave_out.split(",") if t]
        for seed in args.seeds:
            train: dict[str, Any] | None = None
            for rule in RULES.get(method, ("native",)):
                path = cell_path(out, method, seed, rule, args)
                if path.is_file():
                    cells.append(json.loads(path.read_text()))
                    done.append(path.name)
                    continue
                try:
                    train = train or table_runs.train_run(
                        method, seed, args, data_options, per_method.get(method, {}),
                        per_method.get(table_runs.ROUNDS_OF.get(method, ""), {}))
                    cell = run_cell(method, seed, rule, args, train)
                except Exception as exc:  # one broken cell must not lose the others: reported, exit code 1
                    failed.append({"cell": path.name, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                write_json(out / "examples" / path.name, cell.pop("examples"))  # before the cell: it marks done
                write_json(path, cell)
                cells.append(cell)
    cells += matching_cells(out, cells, args)
    evaluation = (f"{'all' if args.limit is None else f'the first {args.limit}'} test examples per task, "
                  + ("greedy" if args.num_beams == 1 else f"{args.num_beams} beams")
                  + f", {args.max_new_tokens} new tokens"
                  + ("" if args.ttp_limit is None else f"; TTP: every model on the first {args.ttp_limit} "
                     "examples of each task"))
    settings = {**vars(args), "evaluation": evaluation, "preset_note": note}
    rows = aggregate(cells)
    scored = {(c["method"], c["seed"], c["rule"]): out / "examples" / cell_path(out, c["method"], c["seed"], c["rule"],
                                                                                 args).name for c in cells}
    examples = {k: table_orderings.read_examples(p) for k, p in scored.items() if p.is_file()}
    orderings = table_orderings.ordering_rows(cells, examples)
    md = markdown(rows, cells, settings, orderings)
    report = {"settings": settings, "skipped": done, "failed": failed, "rows": rows, "cells": cells,
              "orderings": orderings, "markdown": md}
    out.mkdir(parents=True, exist_ok=True)
    (out / "table1.md").write_text(md)
    write_json(out / "table1.json", report)
    print(json.dumps(report, indent=1))
    if failed:
        print(f"paper_table1: {len(failed)} cells failed: {failed}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
