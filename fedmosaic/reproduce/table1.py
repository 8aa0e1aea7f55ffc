"""Paper 000 Table 1 for reproduction: train, evaluate every test example, tabulate mean ± std over seeds.

A *cell* is one method x seed x weighting rule. For each, this trains the run directory
``<out>/<method>/seed<k>`` with the in-process simulator under ``--preset`` (a finished run, with
``summary.json``, is reused; an interrupted one resumes from its last complete round), evaluates it with
the batch evaluator (``fedmosaic eval``: every client on every task's test set, the global and the bare
base model; all test examples unless ``--limit``; predictions cached per decoding setting) and writes
``<out>/cells/<method>__seed<k>__<rule>__<setting>.json`` atomically. A cell whose file exists is skipped,
so the table can be built over several sessions: run the same command again.

FedLoRA and FedDPA-F train exactly FedIT's rounds: with FedIT's run of the seed finished, theirs start from
a copy of its round checkpoints and compute only their end (:mod:`fedmosaic.reproduce.runs`; the cell says
``rounds_from`` and its training seconds include the rounds').

FedDPA-F and FedDPA-T get two cells per seed from one training run: the paper's instance-wise rule
(``paper``, paper 000 section 4.3: the paper's columns) and ``calibrated`` (our extension,
``routing/calibration.py``, its constants chosen per client on a validation split of its training
prompts); every other method is evaluated as it serves (``native``). FedOA runs with ``--leave-out``
(paper 001's leave-one-task-out protocol) when given.

Outputs: ``<out>/table1.md`` (the summary with Personalization and TTP, paper 000 section 5.2, as mean ±
sample std over the seeds, per-task blocks, per-cell training and evaluation seconds; every cell of the
folder made with the same settings), ``<out>/README.md`` (the same tables with what the folder holds) and
``<out>/table1.json``; the JSON report is printed too. Usage::

    fedmosaic reproduce [--methods fedit,fedlora,feddpa-f,feddpa-t,local] [--seeds 0 1 2]
        [--preset repro] [--data feddpa1|generated] [--num-beams 4] [--max-new-tokens 80] [--limit N] [--ttp-limit N]
        [--leave-out TASKS] [--rounds N] [--option METHOD:KEY=VALUE] [--out runs/table1] [--model smollm2]
    fedmosaic reproduce --tables-only --ttp-limit 50 --out bench/results/t1-dpa1   # rewrite the tables only

``--preset`` defaults to ``repro`` when training has it, else ``small`` (said in the report); any preset
training accepts is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from adapters.rundir import RunDir
from fedmosaic.evaluation.evaluate import EvalOptions, evaluate_run, output_dir
from fedmosaic.evaluation.predictions import PredictionCache
from fedmosaic.reproduce import results, runs
from fedmosaic.reproduce.cells import LABELS, cell_path, eval_settings, rules
from fedmosaic.reproduce.options import Table1Options, data_options, default_preset, method_options
from training.algorithms import ALGORITHMS, get_method
from training.settings import method_settings


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


def run_cell(method: str, seed: int, rule: str, opts: Table1Options, train: dict[str, Any]) -> dict[str, Any]:
    """Evaluate one cell (the run is trained) and return its JSON record."""
    run_dir = Path(opts.out) / method / f"seed{seed}"
    eval_opts = EvalOptions(limit=opts.limit, ttp_limit=opts.ttp_limit, max_new_tokens=opts.max_new_tokens,
                            num_beams=opts.num_beams, batch_size=opts.batch_size, metric=opts.metric,
                            dtype=opts.dtype, device=opts.device,
                            feddpa_weighting=None if rule == "native" else rule)
    shared = Path(opts.out) / "base-answers"
    share_base_answers(run_dir, shared, into_run=True)
    began = time.perf_counter()
    summary = evaluate_run(run_dir, eval_opts)
    share_base_answers(run_dir, shared, into_run=False)
    cell: dict[str, Any] = {"method": method, "label": LABELS.get(method, method), "seed": seed, "rule": rule,
                            "preset": opts.preset, "data": opts.data, "metric": opts.metric,
                            "eval": eval_settings(opts),
                            "train_seconds": train.get("train_seconds"), "losses": train.get("losses"),
                            "eval_seconds": round(time.perf_counter() - began, 1),
                            "n_per_task": summary["test_set"]["tasks"]}
    if "answers" in summary:  # eval_seconds paid for the generated ones; the cached came from an earlier call
        cell["answers"] = summary["answers"]
    cell["loss_curves"] = runs.loss_curves(run_dir)
    weights = summary.get("feddpa_weights") or {}
    if "own_client" in weights:  # the run's results.json keeps only its last rule's: the cell keeps its own
        cell["local_weight"] = {"own_task": weights["own_client"]["mean"],
                                "other_tasks": weights["other_clients"]["mean"]}
    if train.get("rounds_from"):  # its rounds are another run's (runs.ROUNDS_OF); seconds include theirs
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
    cell["examples"] = summary.get("example_scores")  # kept apart: <out>/examples/<cell file>
    return cell


def _checked(opts: Table1Options) -> tuple[Table1Options, str | None, list[str]]:
    """``opts`` with its preset resolved, the note saying how, and its methods; refuses what cannot run.

    Raises:
        SystemExit: empty ``--leave-out``, an unknown method or preset (one line naming the known ones).
    """
    if opts.leave_out is not None and not [t for t in opts.leave_out.split(",") if t.strip()]:
        raise SystemExit(f"fedmosaic reproduce: --leave-out needs task names, got {opts.leave_out!r}")
    note = None
    if opts.preset is None:
        preset, note = default_preset()
        opts = dataclasses.replace(opts, preset=preset)
    methods = [m.strip().lower() for m in opts.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"fedmosaic reproduce: unknown methods {unknown}; known: {sorted(ALGORITHMS)}")
    try:
        method_settings(methods[0], opts.resolved_preset(), opts.rounds)
    except ValueError as exc:  # an unknown preset names the known ones
        raise SystemExit(f"fedmosaic reproduce: {exc}") from exc
    return opts, note, methods


def reproduce(opts: Table1Options) -> dict[str, Any]:
    """Make every missing cell, then tabulate the folder's cells; returns (and prints) the JSON report.

    Writes ``<out>/table1.md``, ``<out>/README.md`` and ``<out>/table1.json``. A cell that fails (its run
    or its evaluation raises) is reported under ``failed`` and the others go on.
    """
    opts, note, methods = _checked(opts)
    base_options = data_options(opts.data_option)
    per_method = method_options(opts.option)
    for method, given in per_method.items():  # a typo fails here, not in a cell after others trained
        try:
            get_method(method).check_options(given)
        except ValueError as exc:
            raise SystemExit(f"fedmosaic reproduce: {exc}") from exc
    out = Path(opts.out)
    runs.check_training_settings(out, opts)
    done, failed = [], []
    for method in methods:
        loader_options = dict(base_options)
        if method == "fedoa" and opts.leave_out:
            loader_options["leave_out"] = opts.held_out()
        for seed in opts.seeds:
            train: dict[str, Any] | None = None
            for rule in rules(method):
                path = cell_path(out, method, seed, rule, opts)
                if path.is_file():
                    done.append(path.name)
                    continue
                try:
                    train = train or runs.train_run(
                        method, seed, opts, loader_options, per_method.get(method, {}),
                        per_method.get(runs.ROUNDS_OF.get(method, ""), {}))
                    cell = run_cell(method, seed, rule, opts, train)
                except Exception as exc:  # one broken cell must not lose the others: reported, exit code 1
                    failed.append({"cell": path.name, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                runs.write_json(out / "examples" / path.name, cell.pop("examples"))  # before the cell: it marks done
                runs.write_json(path, cell)
    table = results.tabulate(out, opts)
    settings = {**dataclasses.asdict(opts), **table.settings, "preset_note": note}
    report = {"settings": settings, "skipped": done, "failed": failed, "rows": table.rows, "cells": table.cells,
              "orderings": table.orderings, "markdown": table.markdown}
    results.write(out, table)
    runs.write_json(out / "table1.json", report)
    print(json.dumps(report, indent=1))
    if failed:
        print(f"fedmosaic reproduce: {len(failed)} cells failed: {failed}", file=sys.stderr)
    return report
