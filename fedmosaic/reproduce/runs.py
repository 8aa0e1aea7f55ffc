"""The trained runs behind ``fedmosaic reproduce``'s cells: trained once, resumed, reused, or derived.

``<out>/<method>/seed<k>`` is trained with the in-process simulator; a finished run (``summary.json``)
is reused and an interrupted one resumes from its last complete round. FedLoRA and FedDPA-F train
exactly FedIT's rounds (paper 000 s4.2; ``training/algorithms/local.py``, ``feddpa.py``) and differ only
at the end, where each client fine-tunes the final global (and FedDPA-F embeds its local instances).
So when FedIT's run of the same seed is finished and both methods run at the same settings, their run
starts from a copy of FedIT's round checkpoints and computes only that end: the round loop's resume,
which ends with the adapters of an uninterrupted run (``tests/fedmosaic/reproduce/test_table1.py`` checks the
derived run against one trained from scratch, bit for bit). Its record says where the rounds came from
and counts their seconds, so the table's training time is what the method costs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, cast

from fedmosaic.reproduce.options import Table1Options, read_json
from models import load_base_model
from models.settings import DType
from training.data import load_dataset
from training.federation.rounds import RoundConfig, failure_lines
from training.federation.runfiles import read_rows
from training.settings import method_settings
from training.simulation import SimConfig, run_federated

ROUNDS_OF = {"fedlora": "fedit", "feddpa-f": "fedit"}  # methods whose rounds are another's, bit for bit
FROM = "table1_rounds_from.json"  # in a derived run: whose rounds it holds (kept through an interruption)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically: a reader (or a resumed run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def check_training_settings(out: Path, opts: Table1Options) -> None:
    """Record what the runs under ``out`` are trained with; refuse another setting (the runs would be reused).

    ``--leave-out`` is FedOA's alone, so it is checked per run (:func:`check_run_data`), not here: one
    ``out`` holds the main methods' runs and FedOA's leave-one-task-out run.

    Raises:
        SystemExit: ``out`` holds runs trained otherwise (the message names both settings).
    """
    keys = ("preset", "data", "data_option", "rounds", "model", "option")
    mine = json.loads(json.dumps({k: getattr(opts, k) for k in keys}))  # tuples as the file's lists
    path = out / "table1_settings.json"
    if path.is_file():
        theirs = read_json(path)
        if {k: theirs.get(k) for k in keys} != mine:
            raise SystemExit(f"fedmosaic reproduce: {out} holds runs trained with {theirs}, not {mine}: "
                             "use another --out")
    else:
        write_json(path, mine)


def check_run_data(run_dir: Path, data_options: dict[str, Any]) -> None:
    """Refuse to reuse or resume a run whose data options differ (FedOA's held-out tasks).

    Raises:
        SystemExit: the run at ``run_dir`` was trained on other data options (both are named).
    """
    if (run_dir / "run.json").is_file():
        theirs = read_json(run_dir / "run.json").get("data_options") or {}
        if theirs != data_options:
            raise SystemExit(f"fedmosaic reproduce: {run_dir} was trained with data options {theirs}, "
                             f"not {data_options}: use another --out")


def rounds_source(method: str, seed: int, opts: Table1Options, options: dict[str, Any],
                  source_options: dict[str, Any]) -> Path | None:
    """The finished run whose rounds ``method``'s run may start from, or None (train them).

    Only for :data:`ROUNDS_OF`'s methods, neither given method options, under the same training settings
    and rounds; ``run.json`` absent, so an interrupted run of the method itself resumes as its own (a
    derived run that was interrupted says so in :data:`FROM`).
    """
    source = ROUNDS_OF.get(method)
    out = Path(opts.out)
    if source is None or options or source_options or (out / method / f"seed{seed}" / "run.json").is_file():
        return None
    src = out / source / f"seed{seed}"
    if not (src / "summary.json").is_file() or not (src / "table1_train.json").is_file():
        return None
    mine = method_settings(method, opts.resolved_preset(), opts.rounds)
    theirs = method_settings(source, opts.resolved_preset(), opts.rounds)
    return src if (mine.train, mine.rounds) == (theirs.train, theirs.rounds) else None


def copy_rounds(src: Path, run_dir: Path) -> None:
    """Copy ``src``'s round checkpoints and metrics rows into ``run_dir`` (no run.json: the resume writes it).

    An interrupted copy is harmless: a round whose files do not verify is not a resume point, and the
    next attempt copies again over it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / "rounds", run_dir / "rounds", dirs_exist_ok=True)
    if (src / "metrics.jsonl").is_file():
        shutil.copyfile(src / "metrics.jsonl", run_dir / "metrics.jsonl")


def train_run(method: str, seed: int, opts: Table1Options, data_options: dict[str, Any],
              options: dict[str, Any], source_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train (or reuse, resume, or derive) ``<out>/<method>/seed<k>``; returns its training record.

    Args:
        method: the method.
        seed: the run's seed.
        opts: the invocation's options (``out``, ``preset``, ``rounds``, ``data``, ``model`` ...).
        data_options: the data loader's options.
        options: the method's options (``--option METHOD:KEY=VALUE``).
        source_options: the options given to the method :data:`ROUNDS_OF` names, if any.
    """
    run_dir = Path(opts.out) / method / f"seed{seed}"
    check_run_data(run_dir, data_options)
    record = run_dir / "table1_train.json"
    if record.is_file():
        return trained_cleanly(method, seed, run_dir, {**read_json(record), "reused": True})
    if (run_dir / "summary.json").is_file():  # a run finished before the harness recorded it: its own figures
        done = read_json(run_dir / "summary.json")
        info = {"train_seconds": done.get("seconds"), "rounds": done.get("rounds"),
                "losses": [round(x, 4) for x in done.get("losses", [])], "failures": len(done.get("failures", [])),
                "failure_errors": failure_errors(done.get("failures", []))}
        write_json(record, info)
        return trained_cleanly(method, seed, run_dir, {**info, "reused": True})
    src = rounds_source(method, seed, opts, options, source_options or {})
    if src is not None:
        copy_rounds(src, run_dir)
        write_json(run_dir / FROM, {"rounds_from": f"{src.parent.name}/{src.name}"})
    elif (run_dir / FROM).is_file():  # a derived run interrupted after it began: still the source's rounds
        src = Path(opts.out) / read_json(run_dir / FROM)["rounds_from"]
    eff = method_settings(method, opts.resolved_preset(), opts.rounds, options)
    dataset = load_dataset(opts.data, **data_options)
    # a fresh base per run; load_base_model checks the dtype's text against DTYPES
    loaded = load_base_model(opts.model, dtype=cast(DType | None, opts.dtype), device=opts.device)
    began = time.perf_counter()
    sim = SimConfig(RoundConfig(rounds=eff.rounds, seed=seed))
    result = run_federated(method, dataset, loaded, run_dir, sim, eff.train, eff.options,
                           resume=src is not None or (run_dir / "run.json").is_file(), data_spec=opts.data,
                           data_options=data_options, model_name=opts.model, preset_name=opts.preset)
    seconds = round(time.perf_counter() - began, 1)
    info = {"train_seconds": seconds, "rounds": eff.rounds, "losses": [round(x, 4) for x in result.losses],
            "failures": len(result.failures), "failure_errors": failure_errors(result.failures)}
    if src is not None:  # the rounds are the source's: their losses and seconds, plus this run's end
        shared = read_json(src / "table1_train.json")
        info.update(train_seconds=round(float(shared["train_seconds"]) + seconds, 1), losses=shared["losses"],
                    rounds_from=f"{src.parent.name}/{src.name}", own_seconds=seconds)
    write_json(record, info)
    return trained_cleanly(method, seed, run_dir, {**info, "reused": False})


def failure_errors(failures: list[Any]) -> list[str]:
    """A run's failed client fits (``(round, client, error)`` rows), one line per distinct error, at most
    five: how many, in which rounds, which clients (the train command's own report of them)."""
    return failure_lines([(int(r), str(c), str(e)) for r, c, e in failures])[:5]


def trained_cleanly(method: str, seed: int, run_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Return ``info`` if every client fit of the run succeeded; raise otherwise.

    The round loop leaves a failed client out of its round and goes on (a timeout must not end a long run),
    so a run whose clients all failed still finishes, with its adapters untrained. A table cell compares
    methods at equal work: a run with any failed fit is not one, and is refused by name, with its errors.

    Raises:
        RuntimeError: the run recorded failed client fits.
    """
    if not info.get("failures"):
        return info
    errors = "; ".join(info.get("failure_errors") or ["see its metrics.jsonl"])
    raise RuntimeError(f"{method} seed {seed}: {info['failures']} client fits failed in training ({errors}); "
                       f"no cell is made from {run_dir}: fix the cause, move the run away and run again")


def loss_curves(run_dir: Path) -> dict[str, Any]:
    """A run's training losses from its ``metrics.jsonl``: each ``*loss`` metric's mean over the clients.

    A regulariser's own value (FedOA's ``local_reg``, lambda x D, which its ``local_loss`` includes) is
    kept beside the losses, so a reader can tell the LM loss from the term added to it.

    Returns:
        ``{"rounds": {metric: [mean of round 0, round 1, ...]}, "finalize": {metric: mean}}``: the per-round
        client rows (FedDPA-T's ``loss`` is its global step's, ``local_loss`` its local step's) and the
        end-of-run personalization's rows (FedLoRA's and FedDPA-F's ``finetune_loss``; absent in runs
        trained before those rows were logged).
    """
    per_round: dict[str, dict[int, list[float]]] = {}
    final: dict[str, list[float]] = {}
    for row in read_rows(run_dir / "metrics.jsonl"):
        if "client" not in row or row.get("status") != "ok":
            continue
        for key, value in row.items():
            if key.endswith(("loss", "_reg")) and isinstance(value, int | float):
                if row.get("stage") == "finalize":
                    final.setdefault(key, []).append(float(value))
                else:
                    per_round.setdefault(key, {}).setdefault(int(row["round"]), []).append(float(value))
    mean = statistics.fmean
    return {"rounds": {k: [round(mean(by[r]), 4) for r in sorted(by)] for k, by in per_round.items()},
            "finalize": {k: round(mean(v), 4) for k, v in final.items()}}
