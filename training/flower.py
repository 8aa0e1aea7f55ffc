"""The Flower bridge: the same method objects as a Flower ServerApp / ClientApp (flwr 1.41, Message API).

The server runs our round loop (Flower's "write the loop yourself" option, anchors/federated.md 2.2),
so every method, including multi-message ones later, fits: each round it sends every node a ``train``
message with the method's instructions (the global adapter as an ``ArrayRecord``, the round in a
``ConfigRecord``), collects the uploads, and calls the method's ``aggregate``. Each node is one client
(``partition-id`` from its node config); its private state (the local adapter) lives in
``Context.state`` and is mirrored to disk, since a SuperNode keeps that state in memory only. Only
what the method uploads crosses the network (for FedDPA the global adapter, paper 000 Table 12).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from safetensors.torch import load_file, save_file

from adapters import write_adapter_folder
from adapters.rundir import RunDir
from training.algorithms import get_method
from training.checkpoint import save_round
from training.protocol import ClientContext, FitIns, FitRes, StateDict
from training.runtime import Runtime, TrainConfig, preset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowerConfig:
    """One Flower run (also readable from ``[tool.flwr.app.config]`` / ``--run-config``).

    Attributes:
        method: a registered method name.
        data: data set spec (every node loads the same spec and takes its ``partition-id``).
        rounds: communication rounds.
        out: run directory the server writes (checkpoints, final global adapter).
        model: base model (``smollm2``, ``tiny`` or a folder) loaded once per process.
        preset: training preset name.
        seed: run seed.
        options: method options (JSON object).
        data_options: data set options (JSON object), e.g. the generated suite's sizes.
        client_dir: where nodes mirror their private state (default ``<out>/flower-clients``).
        timeout: seconds the server waits for the replies of a round.
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
def _runtime(model: str, preset_name: str) -> Runtime:
    # One base model per process: Ray actors are reused across rounds in simulation (federated.md 2.3).
    from fedmosaic.models import load_base_model

    return Runtime(load_base_model(model), preset(preset_name))


@functools.lru_cache(maxsize=2)
def _dataset(spec: str, options_json: str):  # noqa: ANN202
    from training.data import load_dataset

    return load_dataset(spec, **json.loads(options_json))


def make_client_app(config: FlowerConfig | None = None) -> ClientApp:
    """A ClientApp running the method's client half; ``config`` None reads ``context.run_config``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = config or FlowerConfig.from_run_config(dict(context.run_config))
        dataset = _dataset(cfg.data, json.dumps(cfg.data_options, sort_keys=True))
        client = dataset.clients[int(context.node_config["partition-id"])]
        rt = _runtime(cfg.model, cfg.preset)
        mirror = Path(cfg.client_dir or Path(cfg.out) / "flower-clients") / client.client_id
        private = _load_private(context, mirror)
        m = get_method(cfg.method)
        opts = {**m.defaults, **cfg.options, "seed": cfg.seed}
        ctx = ClientContext(client.client_id, client, rt, private, cfg.seed)
        round_idx = int(msg.content["config"]["round"])
        state = msg.content["arrays"].to_torch_state_dict()
        if msg.content["config"].get("finalize", False):
            m.client(opts).finalize(state, ctx)
            res = FitRes(client.client_id, {}, len(client.train), {})
        else:
            res = m.client(opts).fit(FitIns(round=round_idx, state=state), ctx)
        _store_private(context, mirror, ctx.private)
        content = RecordDict({
            "arrays": ArrayRecord(torch_state_dict=res.state),
            "metrics": MetricRecord({"num-examples": res.num_examples,
                                     **{k: float(v) for k, v in res.metrics.items()}}),
            "config": ConfigRecord({"client-id": client.client_id}),
        })
        return Message(content=content, reply_to=msg)

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
    """A ServerApp running the method's server half in our round loop."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = config or FlowerConfig.from_run_config(dict(context.run_config))
        m = get_method(cfg.method)
        opts = {**m.defaults, **cfg.options, "seed": cfg.seed}
        rt = _runtime(cfg.model, cfg.preset)
        run = RunDir(Path(cfg.out))
        run.root.mkdir(parents=True, exist_ok=True)
        run.run_json.write_text(json.dumps({"method": m.name, "data": cfg.data, "data_options": cfg.data_options,
                                            "model": cfg.model, "seed": cfg.seed, "rounds": cfg.rounds,
                                            "options": opts, "runtime": "flower", "flower": asdict(cfg),
                                            "inference_weight": m.mixture_weight(opts) or 0.0}, indent=2))
        strategy = m.strategy(opts)
        state = strategy.initial_state(rt)
        nodes = sorted(grid.get_node_ids())
        for r in range(cfg.rounds):
            replies = _round(grid, nodes, r, state, cfg.timeout)
            results, failures = [], []
            for reply in replies:
                if reply.has_error():
                    failures.append((str(reply.metadata.src_node_id), str(reply.error.reason)))
                    continue
                metrics = dict(reply.content["metrics"])
                results.append(FitRes(str(reply.content["config"]["client-id"]),
                                      reply.content["arrays"].to_torch_state_dict(),
                                      int(metrics.pop("num-examples")), metrics))
            new = strategy.aggregate(r, results, failures, state)
            state = new if new is not None else state
            save_round(run, r, state, strategy.state_dict(), {}, rt.train.lora, rt.adapted.base_model_name)
            logger.info("flower round %d: %d results, %d failures", r, len(results), len(failures))
        if m.has_local:
            _round(grid, nodes, cfg.rounds, state, cfg.timeout, finalize=True)
        if state:
            write_adapter_folder(run.global_adapter, rt.train.lora, state, rt.adapted.base_model_name)
        mirror = Path(cfg.client_dir or run.root / "flower-clients")
        for cdir in sorted(mirror.iterdir()) if mirror.is_dir() else []:
            local = cdir / "local.safetensors"
            if local.is_file():
                write_adapter_folder(run.local_adapter(cdir.name), rt.train.lora, load_file(str(local)),
                                     rt.adapted.base_model_name)

    return app


def _round(
    grid: Grid, nodes: list[int], r: int, state: StateDict, timeout: float, finalize: bool = False
) -> list[Message]:
    messages = [
        Message(content=RecordDict({"arrays": ArrayRecord(torch_state_dict=state),
                                    "config": ConfigRecord({"round": r, "finalize": finalize})}),
                dst_node_id=nid, message_type=MessageType.TRAIN)
        for nid in nodes
    ]
    return list(grid.send_and_receive(messages, timeout=timeout))


def run_flower_simulation(config: FlowerConfig, num_clients: int) -> RunDir:
    """Run ``config`` in Flower's simulation runtime with ``num_clients`` virtual SuperNodes."""
    from flwr.simulation import run_simulation

    run_simulation(server_app=make_server_app(config), client_app=make_client_app(config),
                   num_supernodes=num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    return RunDir(Path(config.out))


__all__ = ["FlowerConfig", "make_client_app", "make_server_app", "run_flower_simulation", "TrainConfig"]

# Entry points for `flwr run` (components in pyproject's [tool.flwr.app]): settings from --run-config.
server_app = make_server_app()
client_app = make_client_app()
