"""The Flower bridge: any registered method as a Flower ServerApp / ClientApp (flwr 1.41, Message API).

The ServerApp runs the one round loop (:mod:`training.federation.rounds`) with the Grid transport of
:mod:`training.flower.transport` (Flower's "write the loop yourself" option, anchors/federated.md 2.2),
so every method fits unchanged and a Flower run's directory matches the simulator's: the clients are
selected as the simulator selects them, each node gets one ``train`` message per round with ITS
instructions (wire format: :mod:`training.flower.messages`), and the checkpoints, metrics rows and final
adapters are the loop's.

The ClientApp here is each node's half: it answers ``query.identify`` with the data set client it serves
(its ``partition-id``), runs the method's client ``fit`` on ``train`` and its ``finalize`` on
``train.finalize`` (FedDPA's nodes then embed their own instances for the serving router).

FedAMoLE needs no separate embedding phase: as in the reference loop (docs/methods.md 1.6), clients embed
their embedding set right after local training and upload the embeddings with the round's weights;
the server's RSEA turns them into the next round's assignment (round 0: random scores). So a round
is one message per node, different per node (paper 002, section 4.4).

Each node's private state (a local adapter) lives in ``Context.state`` and is mirrored to disk by
version (:mod:`training.flower.node_state`), since a SuperNode keeps that state in memory only; each message
names the version to start from. Only what the method uploads crosses the network.

``resume`` (``--run-config resume=true``) continues the run in ``out`` after its newest round that
verifies, the nodes' private state included: the server's checkpoint names each client's version, and
the nodes read it from their mirror. The same config and data must be used; the SuperLink, the
ServerApp and the SuperNodes may all be new processes.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecordValues, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from adapters.rundir import RunDir
from models import settings
from models.loaded import check_compile_mode
from training.algorithms import get_method
from training.federation.personalize import finish_client
from training.federation.rounds import RoundConfig, RunPlan, run_record, run_rounds
from training.flower.messages import identity_content, read_fit_content, read_private_versions, reply_content
from training.flower.node_state import PrivateStore
from training.flower.transport import FlowerTransport
from training.local.runtime import Runtime, TrainConfig, preset
from training.protocol import ClientContext, FitRes
from training.state import ClientState


@dataclass(frozen=True)
class FlowerConfig:
    """One Flower run (also readable from ``[tool.flwr.app.config]`` / ``--run-config``).

    Attributes:
        method: a registered method name.
        data: data set spec (every node loads the same spec and takes its ``partition-id``).
        rounds: communication rounds.
        out: run directory the server writes (checkpoints, final adapters); must not hold a run yet,
            unless ``resume``.
        model: base model (``smollm2``, ``tiny`` or a folder).
        preset: training preset name.
        seed: run seed.
        options: method options (JSON object).
        data_options: data set options (JSON object), e.g. the generated suite's sizes.
        client_dir: where nodes mirror their private state (default ``<out>/flower-clients``).
        timeout: seconds the server waits for the replies of one exchange (and, before the first round,
            for every selected client's node to connect).
        fraction: share of clients per round, drawn as the simulator draws them.
        keep_strategy: newest complete rounds that keep their strategy tensors (0: every round).
        clients_per_task: split every task's data into this many clients (paper 000 A.1's 40-client study).
        sample_rate: per-task client sampling each round instead of ``fraction`` (as the simulator's).
        device: where the base model runs: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; empty (the
            default) lets each process decide by its own ``FEDMOSAIC_DEVICE`` (default ``auto``), since
            the server and every SuperNode may sit on different hardware.
        resume: continue the run in ``out`` after its newest round that verifies (private state included).
        compile: empty (the default: eager), or the ``torch.compile`` mode every process compiles the base
            model's decoder layers in for training (``default`` or ``max-autotune``, as ``fedmosaic train
            --compile``); each node compiles once, on its first fit. A run resumes under another mode.
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
    resume: bool = False
    compile: str = ""

    def __post_init__(self) -> None:
        self.round_config()  # the loop's own checks (rounds, fraction, keep_strategy)
        if self.device:
            settings.check_device_spec(self.device, "the Flower run config's device")
        if self.compile:
            check_compile_mode(self.compile, "the Flower run config's compile")
        if not isinstance(self.options, dict):
            raise ValueError(f"the Flower run config's options must be a JSON object, got {self.options!r}")
        # dashed keys spelled as declared: a frozen field, set once here before anything reads it
        object.__setattr__(self, "options",
                           get_method(self.method).check_options(self.options, "the Flower run config's options"))

    def round_config(self) -> RoundConfig:
        """The round loop's part of these settings (the simulator's client selection)."""
        return RoundConfig(rounds=self.rounds, fraction=self.fraction, sample_rate=self.sample_rate, seed=self.seed,
                           keep_strategy=self.keep_strategy)

    @classmethod
    def from_run_config(cls, cfg: dict[str, Any]) -> FlowerConfig:
        """Build from Flower's flat run config (dashed keys; JSON strings for the dict fields).

        Raises:
            ValueError: a key that is not a field (the closest one and every valid key named), or an
                ``options`` entry the method does not declare or whose value is of the wrong type or range.
        """
        kwargs: dict[str, Any] = {}
        fields = sorted(name.replace("_", "-") for name in cls.__dataclass_fields__)
        for key, value in cfg.items():
            name = key.replace("-", "_")
            if name not in cls.__dataclass_fields__:
                close = difflib.get_close_matches(name.replace("_", "-"), fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"the Flower run config has no key {key!r}{hint}; its keys: {', '.join(fields)}")
            decode = name in ("options", "data_options") and isinstance(value, str)
            kwargs[name] = json.loads(value) if decode else value
        return cls(**kwargs)


@functools.lru_cache(maxsize=2)
def _runtime(model: str, preset_name: str, device: str = "", method: str = "fedit", compile_mode: str = "") -> Runtime:
    # One base model per node process: Ray actors are reused across rounds in simulation (federated.md 2.3).
    # Clients load every tensor they train from the message, so the cached adapters never leak into a fit.
    # Keyed by these fields, not the config: its dict fields are not hashable.
    from models import load_base_model

    # the method's own paper regime under the preset's budget, as in the simulator (training/local/regime.py)
    train = preset(preset_name, get_method(method).regime, compile=compile_mode or None)
    return Runtime(load_base_model(model, device=device or None), train)


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
        private_from, private_keep = read_private_versions(msg.content)
        rt = _runtime(cfg.model, cfg.preset, cfg.device, cfg.method, cfg.compile)
        store = PrivateStore(context, _client_dir(cfg) / client.client_id)
        m = get_method(cfg.method)
        opts = {**m.defaults, **cfg.options, "seed": cfg.seed}
        ctx = ClientContext(client.client_id, client, rt, store.load(private_from), cfg.seed)
        if finalize:  # the router's index is built where the instances live

            finals: dict[str, float] = {}

            def personalize(folder: Path) -> ClientState:
                finals.update(finish_client(m, m.client(opts), ins.state, ctx, folder, m.mixture_weight(opts)))
                return ctx.private

            store.save_final(personalize)
            res = FitRes(client.client_id, {}, len(client.train), finals)
        else:
            res = m.client(opts).fit(ins, ctx)
            store.save(ins.round, ctx.private)  # used only if the server aggregates this reply
            store.prune(private_keep)
        return Message(content=reply_content(res), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _fit(msg, context, finalize=False)

    @app.train("finalize")
    def finalize(msg: Message, context: Context) -> Message:
        return _fit(msg, context, finalize=True)

    return app


def make_server_app(config: FlowerConfig | None = None) -> ServerApp:
    """A ServerApp running the method's server half in the round loop (:mod:`training.federation.rounds`)."""
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

    m = get_method(cfg.method)
    if m.centralized:
        raise ValueError(f"{m.name} pools every client's data in one trainer; run it in the simulator")
    opts = {**m.defaults, **cfg.options, "seed": cfg.seed}
    rounds = cfg.round_config()
    train = preset(cfg.preset, m.regime, compile=cfg.compile or None)  # what the nodes train with, recorded
    rt = Runtime(load_base_model(cfg.model, device=cfg.device or None), train)  # initial state
    config = run_record(m, opts, rounds, rt.train, data=cfg.data, data_options=cfg.data_options, model=cfg.model,
                        clients_per_task=cfg.clients_per_task, device=str(rt.device), runtime="flower",
                        flower=asdict(cfg))
    transport = FlowerTransport(grid, cfg.timeout, m.has_local, _client_dir(cfg), rt.train.lora,
                                rt.adapted.base_model_name, keep=cfg.keep_strategy)
    run_rounds(RunPlan(m, opts, _dataset(cfg), rt, run, rounds, config, resume=cfg.resume), transport)


def _client_dir(cfg: FlowerConfig) -> Path:
    """Where the nodes mirror their private state (default ``<out>/flower-clients``)."""
    return Path(cfg.client_dir or Path(cfg.out) / "flower-clients")


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

    resources: dict[str, ConfigRecordValues] = {**client_resources(config, num_clients)}  # flwr's value type
    run_simulation(server_app=make_server_app(config), client_app=make_client_app(config),
                   num_supernodes=num_clients, backend_config={"client_resources": resources})
    return RunDir(Path(config.out))


__all__ = ["FlowerConfig", "make_client_app", "make_server_app", "run_flower_simulation", "TrainConfig"]

# Entry points for `flwr run` (components in pyproject's [tool.flwr.app]): settings from --run-config.
server_app = make_server_app()
client_app = make_client_app()
