"""In-process federated simulation: the round loop, run directory, checkpoints, resume, failures.

Runs any registered method (server and client halves from :mod:`training.algorithms`) on one machine
with every client sharing one frozen base model. Deterministic from a seed: client sampling, adapter
init, shuffling and dropout all derive from (seed, round, client), so ``resume=True`` after an
interruption ends with the same adapters as an uninterrupted run. A client that raises (or exceeds the
soft time limit, measured after its update since CPU work cannot be pre-empted) is logged and left out
of that round's aggregation. Bytes sent and received are recorded per client per round; at the end
each client's local-instance embeddings (final-layer last-token state with the global adapter on,
paper 000 section 4.3) are saved as a faiss index beside its adapter for the serving router.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from adapters import write_adapter_folder
from adapters.rundir import RunDir
from models import LoadedModel
from routing.cache import EmbeddingIndex
from routing.embedding import embed_prompts
from training.algorithms import get_method
from training.checkpoint import last_complete, load_round, prune_strategy_state, save_round
from training.data import ClientData, FederatedDataset, PromptConfig, prompt_texts, sample_clients, split_tasks
from training.protocol import ClientContext, FitRes, StateDict, derive_seed, state_bytes
from training.runtime import Runtime, TrainConfig

logger = logging.getLogger(__name__)


class SimulatedFailure(RuntimeError):
    """Raised for the (round, client) pairs listed in ``SimConfig.failures``."""


@dataclass(frozen=True)
class SimConfig:
    """Round-loop settings.

    Attributes:
        rounds: communication rounds (paper 000: 20).
        fraction: share of clients sampled per round (FedDPA: all).
        sample_rate: per-task client sampling instead (paper 000 A.1's 40-client study).
        seed: the run's seed.
        client_timeout_s: soft per-client time limit (None: none).
        failures: (round, client) pairs that fail on purpose (failure drills, tests).
        embed: save each client's local-instance embeddings at the end.
        keep_strategy: complete rounds that keep their strategy tensors (the resume state; 0: all rounds).
        clients_per_task: split every task's training data into this many clients ``<task>-<j>`` (seeded by
            ``seed``; paper 000 A.1's 40-client study); recorded so evaluation reloads the same clients.
    """

    rounds: int = 20
    fraction: float = 1.0
    sample_rate: float | None = None
    seed: int = 0
    client_timeout_s: float | None = None
    failures: frozenset[tuple[int, str]] = field(default_factory=frozenset)
    embed: bool = True
    keep_strategy: int = 1
    clients_per_task: int = 1

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.clients_per_task < 1:
            raise ValueError(f"clients_per_task must be >= 1, got {self.clients_per_task}")
        if self.keep_strategy < 0:
            raise ValueError(f"keep_strategy must be >= 0 (0 keeps every round), got {self.keep_strategy}")


@dataclass(frozen=True)
class RunSummary:
    """What a finished run reports."""

    run_dir: str
    method: str
    rounds: int
    losses: list[float]
    bytes_up: int
    bytes_down: int
    failures: list[tuple[int, str, str]]
    seconds: float


def select_clients(dataset: FederatedDataset, sim: SimConfig, round_idx: int) -> list[str]:
    """The clients of one round (deterministic in seed and round)."""
    if sim.sample_rate is not None:
        return sample_clients(dataset, sim.sample_rate, round_idx, sim.seed)
    ids = dataset.client_ids
    k = max(1, int(sim.fraction * len(ids)))
    if k == len(ids):
        return ids
    chosen = set(random.Random(derive_seed(sim.seed, "sample", round_idx)).sample(ids, k))
    return [c for c in ids if c in chosen]


def _run_config(method: str, sim: SimConfig, train: TrainConfig, options: dict, data: str, data_options: dict,
                model: str, inference_weight: float | None) -> dict[str, Any]:
    return {"method": method, "data": data, "data_options": data_options, "model": model, "seed": sim.seed,
            "rounds": sim.rounds, "fraction": sim.fraction, "sample_rate": sim.sample_rate,
            "clients_per_task": sim.clients_per_task, "options": options,
            "train": train.asdict(), "inference_weight": inference_weight if inference_weight is not None else 0.0}


def run_federated(
    method: str, dataset: FederatedDataset, loaded: LoadedModel, out_dir: str | Path, sim: SimConfig | int,
    train: TrainConfig, options: dict[str, Any] | None = None, resume: bool = False,
    data_spec: str = "custom", data_options: dict[str, Any] | None = None, model_name: str | None = None,
) -> RunSummary:
    """Train ``method`` on ``dataset`` and write a run directory (see :mod:`adapters.rundir`).

    Args:
        method: a registered method name (:data:`training.algorithms.ALGORITHMS`).
        dataset: the clients and their data.
        loaded: the frozen base model; adapters are injected into it.
        out_dir: the run directory.
        sim: round-loop settings, or just the number of rounds (every other setting at its default).
        train: local training settings (``training.runtime.preset("small")`` on a CPU).
        options: method options over the method's defaults (``alpha``, ``mu``, ``weighting`` ...).
        resume: continue from the last complete round of ``out_dir``.
        data_spec: the data set spec recorded in run.json (evaluation reloads the test sets from it).
        data_options: the loader's options recorded beside it.
        model_name: the base model recorded in run.json (default: the loaded model's name).

    Raises:
        FileExistsError: ``out_dir`` already holds a run and ``resume`` is False (never overwritten).
        ValueError: resuming a run made with other settings.
        AdapterError: another process is writing ``out_dir`` (the run directory's writer lock).
    """
    sim = SimConfig(rounds=sim) if isinstance(sim, int) else sim
    get_method(method)  # an unknown method fails before anything touches the disk
    with RunDir(Path(out_dir)).lock("training"):
        return _run_locked(method, dataset, loaded, out_dir, sim, train, options, resume, data_spec, data_options,
                           model_name)


def _run_locked(
    method: str, dataset: FederatedDataset, loaded: LoadedModel, out_dir: str | Path, sim: SimConfig,
    train: TrainConfig, options: dict[str, Any] | None, resume: bool, data_spec: str,
    data_options: dict[str, Any] | None, model_name: str | None,
) -> RunSummary:
    m = get_method(method)
    opts = {**m.defaults, **(options or {}), "seed": sim.seed}
    run = RunDir(Path(out_dir))
    config = _run_config(m.name, sim, train, opts, data_spec, data_options or {}, model_name or loaded.name,
                         m.mixture_weight(opts))
    start, t0 = 0, time.perf_counter()
    if run.run_json.is_file():
        if not resume:
            raise FileExistsError(f"{run.root} already holds a run; pass resume=True (--resume) or another --out")
        old = run.read_config()
        old.setdefault("clients_per_task", 1)  # run.json written before the field existed
        for key in ("method", "data", "seed", "model", "train", "options", "data_options", "clients_per_task"):
            if json.dumps(old.get(key), sort_keys=True) != json.dumps(config.get(key), sort_keys=True):
                raise ValueError(f"cannot resume {run.root}: its {key} is {old.get(key)!r}, now {config.get(key)!r}")
    run.root.mkdir(parents=True, exist_ok=True)
    # where this (part of the) run trained; not compared on resume: a run may continue on another device
    config["device"] = str(loaded.device)
    run.run_json.write_text(json.dumps(config, indent=2))  # a resume may extend the rounds: record the new count
    if sim.clients_per_task > 1:
        dataset = split_tasks(dataset, sim.clients_per_task, seed=sim.seed)
    if m.centralized:
        pooled = tuple(r for c in dataset.clients for r in c.train)
        dataset = FederatedDataset(dataset.name, (ClientData("all", "all", pooled),), dataset.tests)
    rt = Runtime(loaded, train)
    strategy, client_alg = m.strategy(opts), m.client(opts)
    state: StateDict = strategy.initial_state(rt)
    private: dict[str, dict[str, StateDict]] = {}
    last = last_complete(run) if resume else None
    if last is not None:
        state, sstate, private = load_round(run, last)
        strategy.load_state_dict(sstate)
        start = last + 1
        logger.info("resuming %s after round %d", run.root, last)
    _trim_metrics(run, start)
    failures_all: list[tuple[int, str, str]] = []
    losses: list[float] = []
    up = down = 0
    bar = tqdm(range(start, sim.rounds), desc=f"{m.name} rounds", unit="round", initial=start, total=sim.rounds)
    for r in bar:
        round_began, round_up, round_down = time.perf_counter(), 0, 0
        selected = select_clients(dataset, sim, r)
        instructions = strategy.configure_round(r, selected, state)
        results: list[FitRes] = []
        failures: list[tuple[str, str]] = []
        for cid in selected:
            ins = instructions[cid]
            ctx = ClientContext(cid, dataset.client(cid), rt, private.setdefault(cid, {}), sim.seed)
            before = dict(ctx.private)
            began = time.perf_counter()
            try:
                if (r, cid) in sim.failures:
                    raise SimulatedFailure(f"simulated failure of client {cid} in round {r}")
                res = client_alg.fit(ins, ctx)
                seconds = time.perf_counter() - began
                if sim.client_timeout_s is not None and seconds > sim.client_timeout_s:
                    raise TimeoutError(f"took {seconds:.1f} s > limit {sim.client_timeout_s} s")
            except Exception as exc:  # noqa: BLE001 - any client error is that client's, not the run's
                private[cid] = before
                error = f"{type(exc).__name__}: {exc}"
                failures.append((cid, error))
                logger.warning("round %d: client %s left out: %s", r, cid, error)
                _log(run, {"round": r, "client": cid, "status": "failed", "error": error,
                           "seconds": round(time.perf_counter() - began, 3)})
                continue
            results.append(res)
            b_down, b_up = state_bytes(ins.state), state_bytes(res.state)
            down, up = down + b_down, up + b_up
            round_down, round_up = round_down + b_down, round_up + b_up
            _log(run, {"round": r, "client": cid, "status": "ok", "num_examples": res.num_examples,
                       "bytes_down": b_down, "bytes_up": b_up, "seconds": round(seconds, 3), **res.metrics})
        new = strategy.aggregate(r, results, failures, state)
        state = new if new is not None else state
        server_metrics = strategy.evaluate(r, state) or {}
        mean_loss = sum(x.metrics.get("loss", 0.0) for x in results) / max(1, len(results))
        losses.append(mean_loss)
        failures_all += [(r, c, e) for c, e in failures]
        save_round(run, r, state, strategy.state_dict(), private, train.lora, rt.adapted.base_model_name,
                   peft_global=m.export is None)
        prune_strategy_state(run, sim.keep_strategy)
        _log(run, {"round": r, "aggregate": True, "clients": len(results), "failed": len(failures), "loss": mean_loss,
                   "bytes_up": round_up, "bytes_down": round_down,
                   "seconds": round(time.perf_counter() - round_began, 3), **server_metrics})
        bar.set_postfix(loss=f"{mean_loss:.3f}", failed=len(failures))
    if m.export is not None:
        m.export(run, rt, state, strategy)
    else:
        _finish(run, m, dataset, rt, client_alg, state, private, sim, train, loaded)
    summary = RunSummary(str(run.root), m.name, sim.rounds, losses, up, down, failures_all,
                         round(time.perf_counter() - t0, 2))
    (run.root / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def _finish(run: RunDir, m, dataset, rt, client_alg, state, private, sim, train, loaded) -> None:  # noqa: ANN001
    for c in dataset.clients:
        ctx = ClientContext(c.client_id, c, rt, private.setdefault(c.client_id, {}), sim.seed)
        client_alg.finalize(state, ctx)
    if state:
        write_adapter_folder(run.global_adapter, train.lora, state, rt.adapted.base_model_name)
        rt.set("global", state)
    for cid, named in private.items():
        if "local" in named:
            write_adapter_folder(run.local_adapter(cid), train.lora, named["local"], rt.adapted.base_model_name)
    if sim.embed and state and m.instance_weighting:
        for c in tqdm(dataset.clients, desc="embeddings", unit="client", leave=False):
            save_instance_index(rt, c, run.client_dir(c.client_id))


def save_instance_index(rt: Runtime, client: ClientData, folder: Path) -> None:
    """Embed ``client``'s training instances with the runtime's ``global`` adapter on; save the index in ``folder``.

    Paper 000 section 4.3: final-layer last-token states of the prompts exactly as training formatted
    them, so serving's request embedding (same template, same adapter) is comparable.
    """
    prompts = prompt_texts(client.train, rt.tokenizer, PromptConfig(rt.train.prompt_style))  # type: ignore[arg-type]
    vecs = embed_prompts(rt.model, rt.adapted, rt.tokenizer, prompts, ("global",), autocast=rt.loaded.autocast)
    EmbeddingIndex(vecs).save(folder)


def _log(run: RunDir, row: dict[str, Any]) -> None:
    with run.metrics.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _trim_metrics(run: RunDir, start: int) -> None:
    """Drop metric rows of rounds >= ``start`` (left by an interrupted attempt) before resuming."""
    if not run.metrics.is_file():
        return
    keep = []
    for line in run.metrics.read_text().splitlines():
        try:
            if json.loads(line).get("round", -1) < start:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    run.metrics.write_text("".join(x + "\n" for x in keep))
