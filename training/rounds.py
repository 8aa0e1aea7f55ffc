"""The federated round loop, written once for every runtime: sample, configure, dispatch, collect,
aggregate, checkpoint, log, resume, finish.

A method's server half (:class:`training.protocol.Strategy`) runs here, in the server process. How the
round's instructions reach the clients and how their replies come back is a :class:`Transport`'s job:
the in-process simulator (:mod:`training.simulation`) calls each client's half directly, the Flower bridge
(:mod:`training.flower_transport`) sends one Message per node through the ServerApp's Grid. Per round::

    selected = select_clients(dataset, cfg, r)                  # seeded by (seed, r): same on every runtime
    present, unreachable = transport.reachable(selected)
    instructions = strategy.configure_round(r, present, state)   # one FitIns per client
    replies = transport.fit(r, instructions)                     # results and failures, selection order
    transport.commit(r, accepted)                                # their private state is now current
    state = strategy.aggregate(r, results, failures, state) or state
    checkpoint rounds/<r>/, metrics rows

then the method's ``export`` (FedAMoLE) or the global PEFT folder and ``transport.finalize`` (each
client's personalization and local adapter). A failed client is left out of its round, never the run.
"""

from __future__ import annotations

import json
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tqdm.auto import tqdm

from adapters import write_adapter_folder
from adapters.rundir import RunDir
from training.checkpoint import last_complete, load_round, prune_strategy_state, save_round
from training.data import FederatedDataset, sample_clients
from training.protocol import ClientState, FitIns, FitRes, Method, StateDict, derive_seed, state_bytes
from training.runfiles import append_row, trim_rows, write_json
from training.runtime import Runtime, TrainConfig

logger = logging.getLogger(__name__)

# run.json keys that must match for a resume: they decide what every round computes.
RESUME_KEYS = ("method", "data", "seed", "model", "train", "options", "data_options", "clients_per_task")


class Sampling(Protocol):
    """What client selection reads from a run's settings (:class:`RoundConfig`, ``SimConfig``)."""

    @property
    def fraction(self) -> float: ...

    @property
    def sample_rate(self) -> float | None: ...

    @property
    def seed(self) -> int: ...


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
        if self.keep_strategy < 0:
            raise ValueError(f"keep_strategy must be >= 0 (0 keeps every round), got {self.keep_strategy}")


def select_clients(dataset: FederatedDataset, cfg: Sampling, round_idx: int) -> list[str]:
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
class Reply:
    """One client's answer to its round's instructions: a result, or the reason it has none.

    Attributes:
        client_id: the client the instructions were for.
        result: what it uploaded (None when it failed).
        error: why it failed (None when it answered).
        seconds: how long it took, where the transport can tell (the simulator; not Flower).
    """

    client_id: str
    result: FitRes | None = None
    error: str | None = None
    seconds: float | None = None


class Transport(ABC):
    """How one runtime moves a round's instructions to the clients and their replies back."""

    def reachable(self, clients: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """The selected clients that can be sent to now, and (client, reason) for the others."""
        return list(clients), []

    @abstractmethod
    def fit(self, round_idx: int, instructions: Mapping[str, FitIns]) -> list[Reply]:
        """Send each client its own instructions; one reply per client, in the order of ``instructions``."""

    def commit(self, round_idx: int, accepted: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """The round's results of ``accepted`` are aggregated: their new private state becomes current.

        A client that answered but is not listed keeps the private state it had before the round.
        """

    def private_states(self) -> dict[str, ClientState]:
        """Private tensors the server may checkpoint (the simulator's; a real client keeps its own)."""
        return {}

    def restore(self, private: dict[str, ClientState]) -> None:  # noqa: B027 - optional hook
        """Take back :meth:`private_states` from a checkpoint when a run resumes."""

    def personalize(self, states: Mapping[str, StateDict]) -> None:  # noqa: B027 - optional hook
        """Before :meth:`finalize`: the server's personalised model per client (``Strategy.personal_state``),
        to hand each client in place of the final global state; transports that cannot ignore it."""

    @abstractmethod
    def finalize(self, state: StateDict, run: RunDir) -> None:
        """After the last round: each client's personalization; its local adapter and index into ``run``."""


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
        if json.dumps(old.get(key), sort_keys=True) != json.dumps(config.get(key), sort_keys=True):
            raise ValueError(f"cannot resume {run.root}: its {key} is {old.get(key)!r}, now {config.get(key)!r}")


def run_rounds(plan: RunPlan, transport: Transport) -> RunSummary:
    """Train ``plan.method`` through ``transport`` and write the run directory (see :mod:`adapters.rundir`).

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
    start = 0
    last = last_complete(run) if plan.resume else None
    if last is not None:
        state, strategy_state, private = load_round(run, last)
        strategy.load_state_dict(strategy_state)
        transport.restore(private)
        start = last + 1
        logger.info("resuming %s after round %d", run.root, last)
    trim_rows(run.metrics, start)
    losses: list[float] = []
    up = down = 0
    failures_all: list[tuple[int, str, str]] = []
    bar = tqdm(range(start, cfg.rounds), desc=f"{m.name} rounds", unit="round", initial=start, total=cfg.rounds)
    for r in bar:
        began = time.perf_counter()
        present, failures = transport.reachable(select_clients(plan.dataset, cfg, r))
        instructions = strategy.configure_round(r, present, state)
        results: list[FitRes] = []
        round_up = round_down = 0
        rows: list[dict[str, Any]] = []
        for reply in transport.fit(r, instructions):
            timing = {} if reply.seconds is None else {"seconds": round(reply.seconds, 3)}
            if reply.result is None:
                failures.append((reply.client_id, reply.error or "no reply"))
                rows.append({"round": r, "client": reply.client_id, "status": "failed",
                             "error": reply.error or "no reply", **timing})
                continue
            res = reply.result
            b_down, b_up = state_bytes(instructions[res.client_id].state), state_bytes(res.state)
            round_down, round_up = round_down + b_down, round_up + b_up
            results.append(res)
            rows.append({"round": r, "client": res.client_id, "status": "ok", "num_examples": res.num_examples,
                         "bytes_down": b_down, "bytes_up": b_up, **timing, **res.metrics})
        for cid, error in failures:
            logger.warning("round %d: client %s left out: %s", r, cid, error)
        for row in _unreachable_rows(r, failures, rows) + rows:
            append_row(run.metrics, row)
        transport.commit(r, [res.client_id for res in results])
        new = strategy.aggregate(r, results, failures, state)
        state = new if new is not None else state
        server_metrics = strategy.evaluate(r, state) or {}
        mean_loss = sum(x.metrics.get("loss", 0.0) for x in results) / max(1, len(results))
        losses.append(mean_loss)
        up, down = up + round_up, down + round_down
        failures_all += [(r, c, e) for c, e in failures]
        save_round(run, r, state, strategy.state_dict(), transport.private_states(), plan.runtime.train.lora,
                   plan.runtime.adapted.base_model_name, peft_global=m.export is None)
        prune_strategy_state(run, cfg.keep_strategy)
        append_row(run.metrics, {"round": r, "aggregate": True, "clients": len(results), "failed": len(failures),
                                 "loss": mean_loss, "bytes_up": round_up, "bytes_down": round_down,
                                 "seconds": round(time.perf_counter() - began, 3), **server_metrics})
        bar.set_postfix(loss=f"{mean_loss:.3f}", failed=len(failures))
    if m.export is not None:
        m.export(run, plan.runtime, state, strategy)
    else:
        if state:
            write_adapter_folder(run.global_adapter, plan.runtime.train.lora, state,
                                 plan.runtime.adapted.base_model_name)
        personal = {c: strategy.personal_state(c, state) for c in plan.dataset.client_ids}
        transport.personalize({c: s for c, s in personal.items() if s is not None})
        transport.finalize(state, run)
    summary = RunSummary(str(run.root), m.name, cfg.rounds, losses, up, down, failures_all,
                         round(time.perf_counter() - t0, 2))
    write_json(run.root / "summary.json", asdict(summary))
    return summary


def _unreachable_rows(r: int, failures: list[tuple[str, str]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the clients that failed before dispatch (no node serves them), which have none yet."""
    logged = {row["client"] for row in rows}
    return [{"round": r, "client": c, "status": "failed", "error": e} for c, e in failures if c not in logged]


__all__ = ["Reply", "RoundConfig", "RunPlan", "RunSummary", "Transport", "run_record", "run_rounds", "select_clients"]
