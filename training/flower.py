"""The Flower bridge: any registered method as a Flower ServerApp / ClientApp (flwr 1.41, Message API).

The server runs the simulator's round loop itself (Flower's "write the loop yourself" option,
anchors/federated.md 2.2), so every method fits unchanged:

1. once per run, a ``query.identify`` message to every node: each answers with its ``partition-id``
   and the data set client it serves, giving the node -> client map;
2. each round, the clients are selected as the simulator selects them, the method's
   ``strategy.configure_round`` gives each its own FitIns, and each node gets one ``train`` message
   with ITS instructions (state as an ``ArrayRecord``, config as a ``ConfigRecord``, see
   :mod:`training.flower_messages`); replies become FitRes, an error reply or a missing one is logged
   and left out, then ``aggregate``, ``evaluate``, the round checkpoint (with ``strategy.state_dict()``)
   and the metrics rows, as in :mod:`training.simulation`;
3. at the end, the method's ``export`` when it has one (FedAMoLE: experts, token projections,
   assignments), else a ``train.finalize`` message for methods with a local adapter, then the PEFT
   folders.

FedAMoLE needs no separate embedding phase: as in the reference loop (METHODS.md 1.6), clients embed
their embedding set right after local training and upload the embeddings with the round's weights;
the server's RSEA turns them into the next round's assignment (round 0: random scores). So a round
is one message per node, different per node (paper 002, section 4.4).

Each node's private state (a local adapter) lives in ``Context.state`` and is mirrored to disk, since a
SuperNode keeps that state in memory only. Only what the method uploads crosses the network.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from safetensors.torch import load_file, save_file

from adapters import write_adapter_folder
from adapters.rundir import RunDir
from models import settings
from training.algorithms import get_method
from training.checkpoint import prune_strategy_state, save_round
from training.flower_messages import (
    FINALIZE,
    exchange,
    identify_nodes,
    identity_content,
    read_fit_content,
    reply_content,
)
from training.protocol import ClientContext, FitIns, FitRes, StateDict, state_bytes
from training.runtime import Runtime, TrainConfig, preset
from training.simulation import RunSummary, SimConfig, save_instance_index, select_clients

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowerConfig:
    """One Flower run (also readable from ``[tool.flwr.app.config]`` / ``--run-config``).

    Attributes:
        method: a registered method name.
        data: data set spec (every node loads the same spec and takes its ``partition-id``).
        rounds: communication rounds.
        out: run directory the server writes (checkpoints, final adapters); must not hold a run yet.
        model: base model (``smollm2``, ``tiny`` or a folder).
        preset: training preset name.
        seed: run seed.
        options: method options (JSON object).
        data_options: data set options (JSON object), e.g. the generated suite's sizes.
        client_dir: where nodes mirror their private state (default ``<out>/flower-clients``).
        timeout: seconds the server waits for the replies of one exchange.
        fraction: share of clients per round, drawn as the simulator draws them.
        keep_strategy: newest complete rounds that keep their strategy tensors (0: every round).
        clients_per_task: split every task's data into this many clients (paper 000 A.1's 40-client study).
        sample_rate: per-task client sampling each round instead of ``fraction`` (as the simulator's).
        device: where the base model runs: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; empty (the
            default) lets each process decide by its own ``FEDMOSAIC_DEVICE`` (default ``auto``), since
            the server and every SuperNode may sit on different hardware.
    """

    method: str = "feddpa-t"
    data: str = "generated"
    rounds: int = 2
    out: str = "runs/flower"
    model: str = "smollm2"
    preset: str = "small"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    data_options: dict[str, Any] = field(default_factory=dict)
    client_dir: str = ""
    timeout: float = 3600.0
    fraction: float = 1.0
    keep_strategy: int = 1
    clients_per_task: int = 1
    sample_rate: float | None = None
    device: str = ""

    def __post_init__(self) -> None:
        if self.device:
            settings.check_device_spec(self.device, "the Flower run config's device")

    @classmethod
    def from_run_config(cls, cfg: dict[str, Any]) -> FlowerConfig:
        """Build from Flower's flat run config (dashed keys; JSON strings for the dict fields)."""
        kwargs: dict[str, Any] = {}
        for key, value in cfg.items():
            name = key.replace("-", "_")
            if name in cls.__dataclass_fields__:
                decode = name in ("options", "data_options") and isinstance(value, str)
                kwargs[name] = json.loads(value) if decode else value
        return cls(**kwargs)


@functools.lru_cache(maxsize=2)
def _runtime(model: str, preset_name: str, device: str = "") -> Runtime:
    # One base model per node process: Ray actors are reused across rounds in simulation (federated.md 2.3).
    # Clients load every tensor they train from the message, so the cached adapters never leak into a fit.
    from models import load_base_model

    return Runtime(load_base_model(model, device=device or None), preset(preset_name))


@functools.lru_cache(maxsize=2)
def _load(spec: str, options_json: str, clients_per_task: int, seed: int):  # noqa: ANN202
    from training.data import load_dataset, split_tasks

    dataset = load_dataset(spec, **json.loads(options_json))
    return split_tasks(dataset, clients_per_task, seed=seed) if clients_per_task > 1 else dataset


def _dataset(cfg: FlowerConfig):  # noqa: ANN202
    """The run's clients, the same on the server and on every node (the simulator's split and seed)."""
    return _load(cfg.data, json.dumps(cfg.data_options, sort_keys=True), cfg.clients_per_task, cfg.seed)


def make_client_app(config: FlowerConfig | None = None) -> ClientApp:
    """A ClientApp running the method's client half; ``config`` None reads ``context.run_config``."""
    app = ClientApp()

    def _client(context: Context):  # noqa: ANN202
        cfg = config or FlowerConfig.from_run_config(dict(context.run_config))
        clients = _dataset(cfg).clients
        partition = int(context.node_config["partition-id"])
        if not 0 <= partition < len(clients):
            raise ValueError(f"partition-id {partition} is outside the {len(clients)} clients of {cfg.data!r}")
        return cfg, partition, clients[partition]

    @app.query("identify")
    def identify(msg: Message, context: Context) -> Message:
        _, partition, client = _client(context)
        return Message(content=identity_content(partition, client.client_id), reply_to=msg)

    def _fit(msg: Message, context: Context, finalize: bool) -> Message:
        cfg, _, client = _client(context)
        addressed, ins = read_fit_content(msg.content)
        if addressed != client.client_id:
            raise ValueError(f"this node serves client {client.client_id!r}, the server addressed {addressed!r}")
        rt = _runtime(cfg.model, cfg.preset, cfg.device)
        mirror = Path(cfg.client_dir or Path(cfg.out) / "flower-clients") / client.client_id
        m = get_method(cfg.method)
        opts = {**m.defaults, **cfg.options, "seed": cfg.seed}
        ctx = ClientContext(client.client_id, client, rt, _load_private(context, mirror), cfg.seed)
        if finalize:
            m.client(opts).finalize(ins.state, ctx)
            if m.instance_weighting and ins.state:  # the router's index is built where the instances live
                rt.set("global", ins.state)
                save_instance_index(rt, client, mirror)
            res = FitRes(client.client_id, {}, len(client.train), {})
        else:
            res = m.client(opts).fit(ins, ctx)
        _store_private(context, mirror, ctx.private)
        return Message(content=reply_content(res), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _fit(msg, context, finalize=False)

    @app.train("finalize")
    def finalize(msg: Message, context: Context) -> Message:
        return _fit(msg, context, finalize=True)

    return app


def _load_private(context: Context, mirror: Path) -> dict[str, StateDict]:
    private = {k[len("private."):]: v.to_torch_state_dict() for k, v in context.state.items()
               if k.startswith("private.") and isinstance(v, ArrayRecord)}
    if not private and mirror.is_dir():  # a restarted SuperNode: recover from the disk mirror
        private = {p.stem: load_file(str(p)) for p in mirror.glob("*.safetensors")}
    return private


def _store_private(context: Context, mirror: Path, private: dict[str, StateDict]) -> None:
    mirror.mkdir(parents=True, exist_ok=True)
    for name, state in private.items():
        context.state[f"private.{name}"] = ArrayRecord(torch_state_dict=state)
        save_file({k: v.contiguous() for k, v in state.items()}, str(mirror / f"{name}.safetensors"))


def make_server_app(config: FlowerConfig | None = None) -> ServerApp:
    """A ServerApp running the method's server half in the simulator's round loop."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = config or FlowerConfig.from_run_config(dict(context.run_config))
        run = RunDir(Path(cfg.out))
        with run.lock("flower training"):
            _serve(grid, cfg, run)

    return app


def _serve(grid: Grid, cfg: FlowerConfig, run: RunDir) -> None:
    from models import load_base_model

    t0 = time.perf_counter()
    m = get_method(cfg.method)
    if m.centralized:
        raise ValueError(f"{m.name} pools every client's data in one trainer; run it in the simulator")
    if run.run_json.is_file():
        raise FileExistsError(f"{run.root} already holds a run; pick another out directory")
    opts = {**m.defaults, **cfg.options, "seed": cfg.seed}
    dataset = _dataset(cfg)
    sim = SimConfig(rounds=cfg.rounds, fraction=cfg.fraction, sample_rate=cfg.sample_rate, seed=cfg.seed,
                    embed=False)
    rt = Runtime(load_base_model(cfg.model, device=cfg.device or None), preset(cfg.preset))  # the initial state
    strategy = m.strategy(opts)
    state = strategy.initial_state(rt)
    run.run_json.write_text(json.dumps({
        "method": m.name, "data": cfg.data, "data_options": cfg.data_options, "model": cfg.model, "seed": cfg.seed,
        "rounds": cfg.rounds, "fraction": cfg.fraction, "sample_rate": cfg.sample_rate,
        "clients_per_task": cfg.clients_per_task, "options": opts,
        "train": rt.train.asdict(), "inference_weight": m.mixture_weight(opts) or 0.0, "runtime": "flower",
        "device": str(rt.device), "flower": asdict(cfg)}, indent=2))
    nodes = identify_nodes(grid, cfg.timeout)
    losses: list[float] = []
    up = down = 0
    failures_all: list[tuple[int, str, str]] = []
    for r in range(cfg.rounds):
        began = time.perf_counter()
        selected = select_clients(dataset, sim, r)
        present = [c for c in selected if c in nodes]
        instructions = strategy.configure_round(r, present, state)
        results, failures = exchange(grid, {c: (nodes[c], instructions[c]) for c in present}, cfg.timeout)
        failures += [(c, "no connected node serves this client") for c in selected if c not in nodes]
        for cid, error in failures:
            logger.warning("flower round %d: client %s left out: %s", r, cid, error)
            _log(run, {"round": r, "client": cid, "status": "failed", "error": error})
        round_up = sum(res.bytes for res in results)
        round_down = sum(state_bytes(instructions[res.client_id].state) for res in results)
        for res in results:
            _log(run, {"round": r, "client": res.client_id, "status": "ok", "num_examples": res.num_examples,
                       "bytes_down": state_bytes(instructions[res.client_id].state), "bytes_up": res.bytes,
                       **res.metrics})
        new = strategy.aggregate(r, results, failures, state)
        state = new if new is not None else state
        server_metrics = strategy.evaluate(r, state) or {}
        losses.append(sum(x.metrics.get("loss", 0.0) for x in results) / max(1, len(results)))
        up, down, failures_all = up + round_up, down + round_down, failures_all + [(r, c, e) for c, e in failures]
        save_round(run, r, state, strategy.state_dict(), {}, rt.train.lora, rt.adapted.base_model_name,
                   peft_global=m.export is None)
        prune_strategy_state(run, cfg.keep_strategy)
        _log(run, {"round": r, "aggregate": True, "clients": len(results), "failed": len(failures),
                   "loss": losses[-1], "bytes_up": round_up, "bytes_down": round_down,
                   "seconds": round(time.perf_counter() - began, 3), **server_metrics})
        logger.info("flower round %d: %d results, %d failures", r, len(results), len(failures))
    if m.export is not None:
        m.export(run, rt, state, strategy)
    else:
        _finish(grid, cfg, run, m.has_local, nodes, state, rt)
    summary = RunSummary(str(run.root), m.name, cfg.rounds, losses, up, down, failures_all,
                         round(time.perf_counter() - t0, 2))
    (run.root / "summary.json").write_text(json.dumps(asdict(summary), indent=2))


def _finish(grid: Grid, cfg: FlowerConfig, run: RunDir, has_local: bool, nodes: dict[str, int], state: StateDict,
            rt: Runtime) -> None:
    """Personalize (``train.finalize``) where clients keep a local adapter, then write the PEFT folders."""
    if has_local:
        _, failed = exchange(grid, {c: (nid, FitIns(cfg.rounds, state)) for c, nid in nodes.items()}, cfg.timeout,
                              FINALIZE)
        for cid, error in failed:
            logger.warning("client %s did not finalize: %s", cid, error)
    if state:
        write_adapter_folder(run.global_adapter, rt.train.lora, state, rt.adapted.base_model_name)
    mirror = Path(cfg.client_dir or run.root / "flower-clients")
    for cdir in sorted(mirror.iterdir()) if mirror.is_dir() else []:
        local = cdir / "local.safetensors"
        if local.is_file():
            write_adapter_folder(run.local_adapter(cdir.name), rt.train.lora, load_file(str(local)),
                                 rt.adapted.base_model_name)
        for index_file in sorted(cdir.glob("embeddings.*")):  # FedDPA's instance index, beside the adapter
            run.client_dir(cdir.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(index_file, run.client_dir(cdir.name) / index_file.name)


def _log(run: RunDir, row: dict[str, Any]) -> None:
    with run.metrics.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def client_resources(config: FlowerConfig, num_clients: int) -> dict[str, float]:
    """Ray resources of one virtual SuperNode: a CPU, and an equal share of the GPU on a CUDA run.

    Ray hides every GPU from an actor that asks for none (``CUDA_VISIBLE_DEVICES=""``), so on CUDA the
    nodes ask for ``1 / num_clients`` of it each and share the card (each holds its own base model).
    """
    device = settings.resolve_device(config.device or None)
    share = math.floor(10_000 / max(1, num_clients)) / 10_000 if device.type == "cuda" else 0.0
    return {"num_cpus": 1, "num_gpus": share}


def run_flower_simulation(config: FlowerConfig, num_clients: int) -> RunDir:
    """Run ``config`` in Flower's simulation runtime with ``num_clients`` virtual SuperNodes."""
    from flwr.simulation import run_simulation

    run_simulation(server_app=make_server_app(config), client_app=make_client_app(config),
                   num_supernodes=num_clients,
                   backend_config={"client_resources": client_resources(config, num_clients)})
    return RunDir(Path(config.out))


__all__ = ["FlowerConfig", "make_client_app", "make_server_app", "run_flower_simulation", "TrainConfig"]

# Entry points for `flwr run` (components in pyproject's [tool.flwr.app]): settings from --run-config.
server_app = make_server_app()
client_app = make_client_app()
