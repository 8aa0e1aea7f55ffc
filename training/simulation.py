"""The in-process simulator: every client on one machine, sharing one frozen base model.

The round loop is :mod:`training.federation.rounds`'; this module is its in-process transport and the entry point
:func:`run_federated`. A round's instructions are handed to each client's half of the method directly,
one client after another on the shared runtime; each client's private state stays in this process and
goes into the round checkpoints, so ``resume=True`` after an interruption ends with the same adapters
as an uninterrupted run (every random choice derives from (seed, round, client)). A client that raises,
exceeds the soft time limit (measured after its update, since CPU work cannot be pre-empted) or is
listed in ``SimConfig.failures`` is left out of that round with its private state as before. At the end
each client personalizes (``finalize``), its local adapter is written as a PEFT folder and, for FedDPA,
its local-instance embeddings as a faiss index (paper 000, section 4.3).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from adapters import write_adapter_folder
from adapters.rundir import RunDir
from models import LoadedModel
from training.algorithms import get_method
from training.data import ClientData, FederatedDataset, data_key, split_tasks, write_split
from training.federation import durable
from training.federation.personalize import finish_client
from training.federation.rounds import Reply, RoundConfig, RunPlan, RunSummary, Transport, run_record, run_rounds
from training.local.runtime import Runtime, TrainConfig
from training.protocol import ClientAlgorithm, ClientContext, FitIns, Method
from training.state import ClientState, StateDict


class SimulatedFailure(RuntimeError):
    """Raised for the (round, client) pairs listed in ``SimConfig.failures``."""


@dataclass(frozen=True)
class SimConfig:
    """The simulator's settings: the round loop's (:class:`~training.federation.rounds.RoundConfig`) and its own.

    Attributes:
        loop: the round loop's settings (rounds, client sampling, seed, the strategy tensors kept), the
            same on every runtime.
        client_timeout_s: soft per-client time limit (None: none).
        failures: (round, client) pairs that fail on purpose (failure drills, tests).
        embed: save each client's local-instance embeddings at the end.
        clients_per_task: split every task's training data into this many clients ``<task>-<j>`` (seeded by
            the loop's ``seed``; paper 000 A.1's 40-client study); recorded so evaluation reloads the same clients.
    """

    loop: RoundConfig = RoundConfig()
    client_timeout_s: float | None = None
    failures: frozenset[tuple[int, str]] = field(default_factory=frozenset)
    embed: bool = True
    clients_per_task: int = 1

    def __post_init__(self) -> None:
        if self.clients_per_task < 1:
            raise ValueError(f"clients_per_task must be >= 1, got {self.clients_per_task}")
        if self.client_timeout_s is not None and not self.client_timeout_s >= 0:  # 0: every fit is late (tests)
            raise ValueError(f"client_timeout_s must be >= 0 seconds or None, got {self.client_timeout_s}")


class InProcessTransport(Transport):
    """Runs each client's half of the method in this process, on the shared runtime."""

    def __init__(self, method: Method, client: ClientAlgorithm, dataset: FederatedDataset, rt: Runtime,
                 sim: SimConfig, mixture_weight: float | None = None) -> None:
        self.method, self.client, self.dataset, self.rt, self.sim = method, client, dataset, rt, sim
        self.mixture_weight = mixture_weight  # FedDPA's lambda, checked on held-out examples at the end
        self.private: dict[str, ClientState] = {}
        self._pending: dict[str, ClientState] = {}
        self._personal: dict[str, StateDict] = {}  # the server's personalised model per client (pFedSeq)

    def _context(self, client_id: str, private: ClientState) -> ClientContext:
        return ClientContext(client_id, self.dataset.client(client_id), self.rt, private, self.sim.loop.seed)

    def fit(self, round_idx: int, instructions: Mapping[str, FitIns]) -> list[Reply]:
        self._pending = {}
        replies = []
        for cid, ins in instructions.items():
            ctx = self._context(cid, dict(self.private.get(cid, {})))  # a failed fit leaves the old state
            began = time.perf_counter()
            try:
                if (round_idx, cid) in self.sim.failures:
                    raise SimulatedFailure(f"simulated failure of client {cid} in round {round_idx}")
                res = self.client.fit(ins, ctx)
                seconds = time.perf_counter() - began
                if self.sim.client_timeout_s is not None and seconds > self.sim.client_timeout_s:
                    # the measured time is the row's ``seconds``; kept out of the text so equal failures group
                    raise TimeoutError(f"ran past the client timeout of {self.sim.client_timeout_s} s")
            except Exception as exc:  # noqa: BLE001 - any client error is that client's, not the run's
                replies.append(Reply(cid, error=f"{type(exc).__name__}: {exc}",
                                     seconds=time.perf_counter() - began))
                continue
            self._pending[cid] = ctx.private
            replies.append(Reply(cid, res, seconds=seconds))
        return replies

    def commit(self, round_idx: int, accepted: Sequence[str]) -> None:
        for cid in accepted:
            self.private[cid] = self._pending[cid]
        self._pending = {}

    def private_states(self) -> dict[str, ClientState]:
        return self.private

    def restore(self, private: dict[str, ClientState]) -> None:
        self.private = dict(private)

    def personalize(self, states: Mapping[str, StateDict]) -> None:
        self._personal = dict(states)

    def finalize(self, state: StateDict, run: RunDir) -> dict[str, dict[str, float]]:
        metrics = {}
        for c in tqdm(self.dataset.clients, desc="personalize", unit="client", leave=False):
            ctx = self._context(c.client_id, self.private.setdefault(c.client_id, {}))
            metrics[c.client_id] = finish_client(self.method, self.client, self._personal.get(c.client_id, state),
                                                 ctx, run.client_dir(c.client_id) if self.sim.embed else None,
                                                 self.mixture_weight)
        lora, base = self.rt.train.lora, self.rt.adapted.base_model_name
        for cid, named in self.private.items():
            if "local" in named:
                durable.write_folder(run.local_adapter(cid), functools.partial(
                    write_adapter_folder, config=lora, tensors=named["local"], base_model=base))
        return metrics


def run_federated(
    method: str, dataset: FederatedDataset, loaded: LoadedModel, out_dir: str | Path, sim: SimConfig | int,
    train: TrainConfig, options: dict[str, Any] | None = None, resume: bool = False,
    data_spec: str = "custom", data_options: dict[str, Any] | None = None, model_name: str | None = None,
    preset_name: str | None = None, record: Mapping[str, Any] | None = None,
) -> RunSummary:
    """Train ``method`` on ``dataset`` and write a run directory (see :mod:`adapters.rundir`).

    Args:
        method: a registered method name (:data:`training.algorithms.ALGORITHMS`).
        dataset: the clients and their data.
        loaded: the frozen base model; adapters are injected into it.
        out_dir: the run directory.
        sim: the simulator's settings (``loop``: the round loop's), or just the number of rounds (every other
            setting at its default).
        train: local training settings (``training.local.runtime.preset("small")`` on a CPU).
        options: method options over the method's defaults (``alpha``, ``mu``, ``weighting`` ...).
        resume: continue from the last complete round of ``out_dir``.
        data_spec: the data set spec recorded in run.json (evaluation reloads the test sets from it).
        data_options: the loader's options recorded beside it.
        model_name: the base model recorded in run.json (default: the loaded model's name).
        preset_name: the budget ``train`` was built with, recorded in run.json beside the method's regime.
        record: further entries for run.json (the learning-rate search's scores and choice).

    Raises:
        FileExistsError: ``out_dir`` already holds a run and ``resume`` is False (never overwritten).
        ValueError: resuming a run made with other settings.
        OptionError: an option ``method`` does not declare, or a value of the wrong type or range.
        AdapterError: another process is writing ``out_dir`` (the run directory's writer lock).
    """
    sim = SimConfig(RoundConfig(rounds=sim)) if isinstance(sim, int) else sim
    m = get_method(method)  # an unknown method fails before anything touches the disk
    options = m.check_options(options or {}, "options")  # so does an undeclared option or a bad value
    run = RunDir(Path(out_dir))
    with run.lock("training"):
        if sim.clients_per_task > 1:
            dataset = split_tasks(dataset, sim.clients_per_task, seed=sim.loop.seed)
        # a benchmark's defaults follow its content: a folder holding FedDPA dataset 2 is feddpa2
        opts = {**m.options_for(data_key(data_spec), options, len(dataset.clients)), "seed": sim.loop.seed}
        config = run_record(m, opts, sim.loop, train, data=data_spec, data_options=data_options or {},
                            model=model_name or loaded.name, clients_per_task=sim.clients_per_task,
                            device=str(loaded.device), preset=preset_name, regime=m.regime.asdict(),
                            **(record or {}))
        if dataset.split is not None:  # the clients --partition made: evaluation and calibration reload them
            write_split(run.root, dataset.split)
        if m.centralized:
            pooled = tuple(r for c in dataset.clients for r in c.train)
            dataset = FederatedDataset(dataset.name, (ClientData("all", "all", pooled),), dataset.tests)
        rt = Runtime(loaded, train)
        plan = RunPlan(m, opts, dataset, rt, run, sim.loop, config, resume)
        return run_rounds(plan, InProcessTransport(m, m.client(opts), dataset, rt, sim, m.mixture_weight(opts)))
