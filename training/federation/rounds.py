"""The federated round loop, written once for every runtime: sample, configure, dispatch, collect,
aggregate, checkpoint, log, resume, finish.

A method's server half (:class:`training.protocol.Strategy`) runs here, in the server process. How the
round's instructions reach the clients and how their replies come back is a :class:`Transport`'s job
(:mod:`training.federation.transport`):
the in-process simulator (:mod:`training.simulation`) calls each client's half directly, the Flower bridge
(:mod:`training.flower.transport`) sends one Message per node through the ServerApp's Grid. Per round::

    selected = select_clients(dataset, cfg, r)                  # seeded by (seed, r): same on every runtime
    present, unreachable = transport.reachable(selected)
    instructions = strategy.configure_round(r, present, state)   # one FitIns per client
    replies = transport.fit(r, instructions)                     # results and failures, selection order
    results = the replies that pass validation                   # a bad one: that client is out, reason logged
    metrics rows (durable)
    transport.commit(r, accepted)                                # their private state is now current
    state = strategy.aggregate(r, results, failures, state) or state
    checkpoint rounds/<r>/ (durable, manifest last), with transport.state_dict()

then the method's ``export`` (FedAMoLE) or the global PEFT folder and ``transport.finalize`` (each
client's personalization and local adapter). A failed client is left out of its round, never the run.
A resume continues after the newest round whose checkpoint verifies
(:func:`training.federation.checkpoint.last_complete`).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from adapters import write_adapter_folder
from adapters.rundir import RunDir
from training.data import FederatedDataset, sample_clients
from training.federation import durable
from training.federation.checkpoint import (
    last_complete,
    load_round,
    load_transport_state,
    prune_strategy_state,
    save_round,
)
from training.federation.runfiles import append_row, trim_rows, write_json
from training.federation.transport import Reply, Transport
from training.federation.validation import reply_problem
from training.local.runtime import Runtime, TrainConfig
from training.protocol import FitIns, FitRes, Method, Strategy
from training.state import StateDict, derive_seed, state_bytes

logger = logging.getLogger(__name__)

# run.json keys that must match for a resume: they decide what every round computes.
RESUME_KEYS = ("method", "data", "seed", "model", "train", "options", "data_options", "clients_per_task")


@dataclass(frozen=True)
class RoundConfig:
    """The loop's settings, the same on every runtime.

    Attributes:
        rounds: communication rounds (paper 000: 20).
        fraction: share of clients sampled per round (FedDPA: all).
        sample_rate: per-task client sampling instead (paper 000 A.1's 40-client study).
        seed: the run's seed.
        keep_strategy: complete rounds that keep their strategy tensors (the resume state; 0: all rounds).
    """

    rounds: int = 20
    fraction: float = 1.0
    sample_rate: float | None = None
    seed: int = 0
    keep_strategy: int = 1

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:  # checked before round 0, not in it
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.keep_strategy < 0:
            raise ValueError(f"keep_strategy must be >= 0 (0 keeps every round), got {self.keep_strategy}")


def select_clients(dataset: FederatedDataset, cfg: RoundConfig, round_idx: int) -> list[str]:
    """The clients of one round (deterministic in seed and round), in the data set's order."""
    if cfg.sample_rate is not None:
        return sample_clients(dataset, cfg.sample_rate, round_idx, cfg.seed)
    ids = dataset.client_ids
    k = max(1, int(cfg.fraction * len(ids)))
    if k == len(ids):
        return ids
    chosen = set(random.Random(derive_seed(cfg.seed, "sample", round_idx)).sample(ids, k))
    return [c for c in ids if c in chosen]


@dataclass(frozen=True)
class RunSummary:
    """What a finished run reports (``summary.json``)."""

    run_dir: str
    method: str
    rounds: int
    losses: list[float]
    bytes_up: int
    bytes_down: int
    failures: list[tuple[int, str, str]]
    seconds: float
    # rounds of this invocation that aggregated no client's update (every fit failed): the state did not move
    empty_rounds: list[int] = field(default_factory=list)


def failure_lines(failures: list[tuple[int, str, str]]) -> list[str]:
    """One line per distinct error of a run's failed client fits: how many, which rounds and clients.

    Args:
        failures: ``(round, client, error)`` rows, as :class:`RunSummary` keeps them.
    """
    by_error: dict[str, list[tuple[int, str]]] = {}
    for r, cid, error in failures:
        by_error.setdefault(" ".join(error.split())[:300], []).append((r, cid))  # one line each, bounded
    lines = []
    for error, where in by_error.items():
        rounds = sorted({r for r, _ in where})
        clients = sorted({c for _, c in where})
        shown = ", ".join(clients[:4]) + (f" and {len(clients) - 4} more" if len(clients) > 4 else "")
        lines.append(f"{len(where)} failed (round {', '.join(map(str, rounds))}; {shown}): {error}")
    return lines


@dataclass(frozen=True)
class RunPlan:
    """Everything the loop needs besides the transport.

    Attributes:
        method: the registered method.
        options: its options (defaults, the user's, and ``seed``).
        dataset: the run's clients (already split per task, or pooled for Centralized).
        runtime: the server's base model with the adapter slots (initial state, export).
        run: the run directory.
        rounds: the loop's settings.
        config: what ``run.json`` records.
        resume: continue from the newest complete round of ``run``.
    """

    method: Method
    options: dict[str, Any]
    dataset: FederatedDataset
    runtime: Runtime
    run: RunDir
    rounds: RoundConfig
    config: dict[str, Any]
    resume: bool = False


def run_record(method: Method, options: Mapping[str, Any], cfg: RoundConfig, train: TrainConfig, *, data: str,
               data_options: Mapping[str, Any], model: str, clients_per_task: int, device: str,
               **extra: Any) -> dict[str, Any]:
    """What ``run.json`` records: the settings a resume must match (:data:`RESUME_KEYS`) and the rest.

    ``inference_weight`` is FedDPA's lambda under these options (0 when clients do not mix); ``device``
    is where this (part of the) run trained, not compared on resume (a run may continue elsewhere);
    ``extra`` adds runtime-specific entries.
    """
    weight = method.mixture_weight(options)
    return {"method": method.name, "data": data, "data_options": dict(data_options), "model": model,
            "seed": cfg.seed, "rounds": cfg.rounds, "fraction": cfg.fraction, "sample_rate": cfg.sample_rate,
            "clients_per_task": clients_per_task, "options": dict(options), "train": train.asdict(),
            "inference_weight": weight if weight is not None else 0.0, "device": device, **extra}


def _check_resumable(run: RunDir, config: Mapping[str, Any]) -> None:
    old = run.read_config()
    old.setdefault("clients_per_task", 1)  # run.json written before the field existed
    for key in RESUME_KEYS:
        before, now = _compared(key, old.get(key)), _compared(key, config.get(key))
        if json.dumps(before, sort_keys=True) != json.dumps(now, sort_keys=True):
            raise ValueError(f"cannot resume {run.root}: its {key} is {old.get(key)!r}, now {config.get(key)!r}")


def _compared(key: str, value: Any) -> Any:
    """What a resume must match: the training settings without ``compile``, which says how the steps ran
    (like ``device``, and absent from runs recorded before it existed), not what they compute."""
    if key == "train" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "compile"}
    return value


def _resume_point(plan: RunPlan, strategy: Strategy, transport: Transport) -> tuple[int, StateDict | None]:
    """(first round to run, restored server state or None) from the newest round that verifies."""
    run = plan.run
    clients = run.root / "adapters" / "clients"  # the export's folders are written beside their destination
    folders = [run.root, run.root / "rounds", run.root / "adapters", run.amole, clients,
               *(sorted(p for p in clients.iterdir() if p.is_dir()) if clients.is_dir() else [])]
    for leftover in [stale for folder in folders for stale in durable.leftovers(folder)]:
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()  # an interrupted write's
    last = last_complete(run) if plan.resume else None
    if last is None:
        return 0, None
    state, strategy_state, private = load_round(run, last)
    strategy.load_state_dict(strategy_state)
    transport.restore(private)
    transport.load_state_dict(load_transport_state(run, last))
    logger.info("resuming %s after round %d", run.root, last)
    return last + 1, state


def _collect(plan: RunPlan, strategy: Strategy, r: int, instructions: Mapping[str, FitIns], replies: list[Reply],
             failures: list[tuple[str, str]]) -> tuple[list[FitRes], list[dict[str, Any]]]:
    """The round's valid results and every client's metrics row; bad replies join ``failures``."""
    results: list[FitRes] = []
    rows: list[dict[str, Any]] = []
    for reply in replies:
        timing = {} if reply.seconds is None else {"seconds": round(reply.seconds, 3)}
        cid, res = reply.client_id, reply.result
        if res is None:
            failures.append((cid, reply.error or "no reply"))
            rows.append({"round": r, "client": cid, "status": "failed", "error": reply.error or "no reply", **timing})
            continue
        problem = reply_problem(res, instructions[cid], strategy, cid, len(plan.dataset.client(cid).train))
        if problem is not None:  # the client is out of this round, its private state as before
            failures.append((cid, f"rejected: {problem}"))
            rows.append({"round": r, "client": cid, "status": "rejected", "error": problem, **timing})
            continue
        b_down, b_up = state_bytes(instructions[cid].state), state_bytes(res.state)
        results.append(res)
        rows.append({"round": r, "client": cid, "status": "ok", "num_examples": res.num_examples,
                     "bytes_down": b_down, "bytes_up": b_up, **timing, **res.metrics})
    return results, rows


def run_rounds(plan: RunPlan, transport: Transport) -> RunSummary:
    """Train ``plan.method`` through ``transport`` and write the run directory (see :mod:`adapters.rundir`).

    Every reply is checked (:func:`training.federation.validation.reply_problem`) before aggregation; a bad one
    leaves its client out of the round with the reason in its metrics row. A round's rows are durable
    before its checkpoint, and the checkpoint's manifest is written last, so a resume (from the newest
    round that verifies) never lacks a row of a round it skips.

    Raises:
        FileExistsError: the run directory holds a run and ``plan.resume`` is False (never overwritten).
        ValueError: resuming a run made with other settings.
    """
    m, run, cfg = plan.method, plan.run, plan.rounds
    t0 = time.perf_counter()
    if run.run_json.is_file():
        if not plan.resume:
            raise FileExistsError(f"{run.root} already holds a run; resume it (resume=True, --resume) "
                                  "or pick another out directory")
        _check_resumable(run, plan.config)
    run.root.mkdir(parents=True, exist_ok=True)
    write_json(run.run_json, plan.config)  # a resume may extend the rounds: record the new count
    strategy = m.strategy(plan.options)
    state: StateDict = strategy.initial_state(plan.runtime)
    start, restored = _resume_point(plan, strategy, transport)
    state = restored if restored is not None else state
    trim_rows(run.metrics, start)
    losses: list[float] = []
    up = down = 0
    failures_all: list[tuple[int, str, str]] = []
    empty: list[int] = []
    bar = tqdm(range(start, cfg.rounds), desc=f"{m.name} rounds", unit="round", initial=start, total=cfg.rounds)
    for r in bar:
        began = time.perf_counter()
        present, failures = transport.reachable(select_clients(plan.dataset, cfg, r))
        instructions = strategy.configure_round(r, present, state)
        unreachable = list(failures)
        results, rows = _collect(plan, strategy, r, instructions, transport.fit(r, instructions), failures)
        for cid, error in failures:
            logger.warning("round %d: client %s left out: %s", r, cid, error)
        for row in _unreachable_rows(r, unreachable, rows) + rows:
            append_row(run.metrics, row)
        transport.commit(r, [res.client_id for res in results])
        new = strategy.aggregate(r, results, failures, state)
        state = new if new is not None else state
        server_metrics = strategy.evaluate(r, state) or {}
        mean_loss = sum(x.metrics.get("loss", 0.0) for x in results) / max(1, len(results))
        losses.append(mean_loss)
        round_up, round_down = sum(x.get("bytes_up", 0) for x in rows), sum(x.get("bytes_down", 0) for x in rows)
        up, down = up + round_up, down + round_down
        failures_all += [(r, c, e) for c, e in failures]
        empty += [r] if not results else []
        append_row(run.metrics, {"round": r, "aggregate": True, "clients": len(results), "failed": len(failures),
                                 "loss": mean_loss, "bytes_up": round_up, "bytes_down": round_down,
                                 "seconds": round(time.perf_counter() - began, 3), **server_metrics})
        save_round(run, r, state, strategy.state_dict(), transport.private_states(), plan.runtime.train.lora,
                   plan.runtime.adapted.base_model_name, peft_global=m.export is None,
                   transport=transport.state_dict())
        prune_strategy_state(run, cfg.keep_strategy)
        bar.set_postfix(loss=f"{mean_loss:.3f}", failed=len(failures))
    if m.export is not None:
        m.export(run, plan.runtime, state, strategy)
    else:
        if state:
            lora, base = plan.runtime.train.lora, plan.runtime.adapted.base_model_name
            durable.write_folder(run.global_adapter, lambda tmp: write_adapter_folder(tmp, lora, state, base))
        personal = {c: strategy.personal_state(c, state) for c in plan.dataset.client_ids}
        transport.personalize({c: s for c, s in personal.items() if s is not None})
        finals = transport.finalize(state, run)
        for cid in sorted(finals):  # after the rounds: trim_rows drops them if the run resumes or extends
            if finals[cid]:
                append_row(run.metrics, {"round": cfg.rounds, "stage": "finalize", "client": cid, "status": "ok",
                                         **finals[cid]})
    summary = RunSummary(str(run.root), m.name, cfg.rounds, losses, up, down, failures_all,
                         round(time.perf_counter() - t0, 2), empty)
    write_json(run.root / "summary.json", asdict(summary))
    return summary


def _unreachable_rows(r: int, failures: list[tuple[str, str]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the clients that failed before dispatch (no node serves them), which have none yet."""
    logged = {row["client"] for row in rows}
    return [{"round": r, "client": c, "status": "failed", "error": e} for c, e in failures if c not in logged]


__all__ = ["Reply", "RoundConfig", "RunPlan", "RunSummary", "Transport", "run_record", "run_rounds", "select_clients"]
