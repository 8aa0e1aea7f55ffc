"""The Flower bridge: the wire format (through Flower's own protobuf serde, fast) and FedDPA-T, FedAMoLE and
pFedSeq on Flower's simulation runtime (the tiny model) against the in-process simulator.

The Ray simulations dominate the time (Ray and actor start-up, about half a minute each on two
cores), so each keeps to 2 clients, 4 examples per client, the tiny preset and 2-3 rounds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from safetensors.torch import load_file

from adapters import inject
from adapters.amole_io import load_amole
from adapters.rundir import RunDir
from models import tiny_llama
from routing.cache import EmbeddingIndex
from training.algorithms import get_method
from training.algorithms.fedamole.method import FedAMoLEStrategy, _cfg, subset
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.flower.app import FlowerConfig, run_flower_simulation
from training.flower.messages import (
    decode_config,
    encode_config,
    fit_content,
    identity_content,
    read_fit_content,
    read_identity,
    read_reply_content,
    reply_content,
)
from training.local.runtime import Runtime, preset
from training.protocol import FitIns, FitRes
from training.simulation import SimConfig, run_federated
from training.state import state_bytes

DATA_OPTIONS = {"n_train": 4, "n_test": 2, "families": ["sorting", "capitals"]}
AMOLE = {"num_experts": 5, "expert_choices": 1, "min_experts": 2, "max_experts": 3}  # 5 experts over 2 clients


def _wire(content):  # noqa: ANN001, ANN202
    """What the other side receives: the content through Flower's protobuf serialisation."""
    return recorddict_from_proto(recorddict_to_proto(content))


def test_config_values_cross_the_wire() -> None:
    config = {"assignment": {"layers.0.q_proj": [1, 4], "layers.0.v_proj": [0]}, "personalized": True, "lr": 0.5,
              "steps": 3, "name": "x", "ids": [2, 3], "empty": [], "pair": (1, "a"), "blob": b"\x00\x01"}
    record = encode_config(config)
    assert isinstance(record["json.assignment"], str) and record["ids"] == [2, 3]  # nested as JSON, flat as is
    back = decode_config(_wire(fit_content(FitIns(0, {}, config), "c"))["fitins"])
    assert back == {**config, "pair": [1, "a"]}
    assert type(back["personalized"]) is bool and type(back["steps"]) is int


def test_config_refuses_what_cannot_travel() -> None:
    with pytest.raises(TypeError, match="'w'.*FitIns.state"):
        encode_config({"w": torch.zeros(2)})
    with pytest.raises(TypeError, match="json."):
        encode_config({"json.x": 1})


def test_fit_and_reply_round_trip() -> None:
    state = {"a.lora_A": torch.randn(2, 3), "a.lora_B": torch.zeros(3, 2, dtype=torch.float64)}
    client, ins = read_fit_content(_wire(fit_content(FitIns(7, state, {"k": 1}), "capitals")))
    assert client == "capitals" and ins.round == 7 and ins.config == {"k": 1}
    assert all(torch.equal(ins.state[k], state[k]) and ins.state[k].dtype == state[k].dtype for k in state)
    res = read_reply_content(_wire(reply_content(FitRes("capitals", state, 12, {"loss": 0.25, "steps": 2}))))
    assert res.client_id == "capitals" and res.num_examples == 12 and res.metrics == {"loss": 0.25, "steps": 2.0}
    assert all(torch.equal(res.state[k], state[k]) for k in state)
    assert read_identity(_wire(identity_content(3, "sorting"))) == (3, "sorting")


def test_each_fedamole_client_gets_its_own_instructions(tiny) -> None:  # noqa: ANN001
    strategy = FedAMoLEStrategy(_cfg(AMOLE))
    state = strategy.initial_state(Runtime(tiny, preset("tiny")))
    sent = strategy.configure_round(0, ["sorting", "capitals"], state)
    got = {c: read_fit_content(_wire(fit_content(ins, c))) for c, ins in sent.items()}
    assert sent["sorting"].config != sent["capitals"].config  # different messages in one round
    for client, (addressed, ins) in got.items():
        assert addressed == client and ins.config == sent[client].config
        assert set(ins.state) == set(subset(state, ins.config["assignment"], True))  # its experts only
        assert all(torch.equal(ins.state[k], state[k]) for k in ins.state)


def test_feddpa_t_on_flower_simulation_matches_the_simulator(tmp_path: Path) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cfg = FlowerConfig(method="feddpa-t", data="generated", rounds=2, out=str(tmp_path / "flower"), model="tiny",
                       preset="tiny", data_options=DATA_OPTIONS)
    flower = run_flower_simulation(cfg, num_clients=2)
    local = RunDir(tmp_path / "local")
    run_federated("feddpa-t", generate_suite(**DATA_OPTIONS), tiny_llama(), local.root,
                  SimConfig(RoundConfig(rounds=2)), preset("tiny"), data_spec="generated", data_options=DATA_OPTIONS)
    a = load_file(str(flower.global_adapter / "adapter_model.safetensors"))
    b = load_file(str(local.global_adapter / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    for client in ("sorting", "capitals"):
        fa = load_file(str(flower.local_adapter(client) / "adapter_model.safetensors"))
        fb = load_file(str(local.local_adapter(client) / "adapter_model.safetensors"))
        assert all(torch.allclose(fa[k], fb[k], atol=1e-6) for k in fa)  # private state kept on the node
        mirror = Path(cfg.out) / "flower-clients" / client  # mirrored to disk: each round by version, then final
        assert (mirror / "final" / "local.safetensors").is_file() and (mirror / "v1" / "local.safetensors").is_file()
        # the node embedded its own instances for the serving router, as the simulator does
        np.testing.assert_allclose(EmbeddingIndex.load(flower.client_dir(client)).raw,
                                   EmbeddingIndex.load(local.client_dir(client)).raw, atol=1e-5)
    assert (flower.round_dir(1) / "COMPLETE").is_file()
    assert flower.read_config()["device"] == local.read_config()["device"] == "cpu"  # the run records its device


def test_a_nodes_fine_tune_reports_its_loss_as_the_simulator_does(tmp_path: Path) -> None:
    """FedLoRA: each node's end-of-run fine-tune comes back in its finalize reply and is logged like the simulator's."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cfg = FlowerConfig(method="fedlora", data="generated", rounds=1, out=str(tmp_path / "flower"), model="tiny",
                       preset="tiny", data_options=DATA_OPTIONS)
    flower = run_flower_simulation(cfg, num_clients=2)
    local = RunDir(tmp_path / "local")
    run_federated("fedlora", generate_suite(**DATA_OPTIONS), tiny_llama(), local.root,
                  SimConfig(RoundConfig(rounds=1), embed=False), preset("tiny"), data_spec="generated",
                  data_options=DATA_OPTIONS)
    rows, sim_rows = _rows(flower), _rows(local)
    for client in ("sorting", "capitals"):
        assert rows[(1, client)]["stage"] == sim_rows[(1, client)]["stage"] == "finalize"
        assert rows[(1, client)]["finetune_loss"] == pytest.approx(sim_rows[(1, client)]["finetune_loss"], abs=1e-5)


def _rows(run: RunDir) -> dict[tuple[int, str], dict]:
    rows = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    return {(x["round"], x["client"]): x for x in rows if "client" in x}


def test_fedamole_on_flower_simulation_matches_the_simulator(tmp_path: Path) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cfg = FlowerConfig(method="fedamole", data="generated", rounds=2, out=str(tmp_path / "flower"), model="tiny",
                       preset="tiny", options=AMOLE, data_options=DATA_OPTIONS)
    # A third SuperNode has no data partition: it fails to identify itself, is logged and left out.
    flower = run_flower_simulation(cfg, num_clients=3)
    local = RunDir(tmp_path / "local")
    run_federated("fedamole", generate_suite(**DATA_OPTIONS), tiny_llama(), local.root,
                  SimConfig(RoundConfig(rounds=2), embed=False), preset("tiny", get_method("fedamole").regime), AMOLE,
                  data_spec="generated",
                  data_options=DATA_OPTIONS)
    assert json.loads((flower.root / "summary.json").read_text())["failures"] == []
    assert not flower.global_adapter.exists()  # the method's export replaces the PEFT folders
    server = load_file(str(flower.round_dir(0) / "server.safetensors"))
    rank = next(v for k, v in server.items() if k.endswith(".token_proj")).shape[0]
    rows, sim_rows = _rows(flower), _rows(local)
    for r in (0, 1):
        fs, ls = (json.loads((run.round_dir(r) / "strategy.json").read_text()) for run in (flower, local))
        assert fs["assignment"] == ls["assignment"]
        for m, scores in fs["scores"].items():
            torch.testing.assert_close(torch.tensor(scores), torch.tensor(ls["scores"][m]))
        for client in ("sorting", "capitals"):
            mine = {m: per[client] for m, per in fs["assignment"].items()}
            down = state_bytes(subset(server, mine, True))
            # each node trained and uploaded exactly the experts of its own instructions (+ their embeddings)
            assert rows[(r, client)]["bytes_down"] == down
            assert rows[(r, client)]["bytes_up"] == down + 4 * rank * sum(1 + len(ids) for ids in mine.values())
            assert rows[(r, client)]["loss"] == pytest.approx(sim_rows[(r, client)]["loss"], abs=1e-5)
    a = load_file(str(flower.amole / "amole_model.safetensors"))
    b = load_file(str(local.amole / "amole_model.safetensors"))
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assignments, top_k = load_amole(inject(tiny_llama().model), flower.amole)
    assert top_k == 2 and assignments == load_amole(inject(tiny_llama().model), local.amole)[0]
    assert set(assignments) == {"sorting", "capitals"}


PFEDSEQ = {"warmup": 1, "window": 2, "server_device": "cpu"}


def test_pfedseq_on_flower_simulation_matches_the_simulator(tmp_path: Path) -> None:
    """Round 0 is the warm-up; rounds 1-2 send each node its own calibrated adapter (paper 003 Alg. 1)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cfg = FlowerConfig(method="pfedseq", data="generated", rounds=3, out=str(tmp_path / "flower"), model="tiny",
                       preset="tiny", options=PFEDSEQ, data_options=DATA_OPTIONS)
    flower = run_flower_simulation(cfg, num_clients=2)
    local = RunDir(tmp_path / "local")
    run_federated("pfedseq", generate_suite(**DATA_OPTIONS), tiny_llama(), local.root,
                  SimConfig(RoundConfig(rounds=3), embed=False), preset("tiny", get_method("pfedseq").regime), PFEDSEQ,
                  data_spec="generated",
                  data_options=DATA_OPTIONS)
    rows, sim_rows = _rows(flower), _rows(local)
    for r in (0, 1, 2):
        for client in ("sorting", "capitals"):
            assert rows[(r, client)]["loss"] == pytest.approx(sim_rows[(r, client)]["loss"], abs=1e-5)
            assert rows[(r, client)]["bytes_up"] == sim_rows[(r, client)]["bytes_up"]  # only the update travels
    personalized = []
    for client in ("sorting", "capitals"):
        fa = load_file(str(flower.local_adapter(client) / "adapter_model.safetensors"))
        fb = load_file(str(local.local_adapter(client) / "adapter_model.safetensors"))
        assert set(fa) == set(fb) and all(torch.allclose(fa[k], fb[k], atol=1e-6) for k in fa)
        personalized.append(fa)
    assert any(not torch.equal(personalized[0][k], personalized[1][k]) for k in personalized[0])
    strategy = load_file(str(flower.round_dir(2) / "strategy.safetensors"))
    sim_strategy = load_file(str(local.round_dir(2) / "strategy.safetensors"))
    assert set(strategy) == set(sim_strategy)  # history and learner state checkpointed on Flower too
    assert all(torch.allclose(strategy[k], sim_strategy[k], atol=1e-5) for k in strategy)


def test_nodes_and_server_see_the_simulators_split_and_per_task_sampling() -> None:
    from training.data import split_tasks
    from training.federation.rounds import select_clients
    from training.flower.app import _dataset

    cfg = FlowerConfig.from_run_config({"data": "generated", "data-options": json.dumps(DATA_OPTIONS),
                                        "clients-per-task": 2, "sample-rate": 0.5, "seed": 3})
    assert cfg.clients_per_task == 2 and cfg.sample_rate == 0.5
    ours = _dataset(cfg)
    reference = split_tasks(generate_suite(**DATA_OPTIONS), 2, seed=3)
    assert [(c.client_id, c.train) for c in ours.clients] == [(c.client_id, c.train) for c in reference.clients]
    sim = RoundConfig(rounds=4, sample_rate=0.5, seed=3)
    for r in range(4):  # one client of each task's two per round, the simulator's draw
        picked = select_clients(ours, sim, r)
        assert len(picked) == 2 and {c.rsplit("-", 1)[0] for c in picked} == {"sorting", "capitals"}


def test_compile_in_the_run_config_compiles_every_nodes_layers(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cache = tmp_path / "inductor"  # the nodes' processes inherit it: what they compile lands here
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    cfg = FlowerConfig.from_run_config({"method": "fedit", "data": "generated", "rounds": 1, "model": "tiny",
                                        "preset": "tiny", "out": str(tmp_path / "flower"), "compile": "default",
                                        "data-options": json.dumps(DATA_OPTIONS)})
    flower = run_flower_simulation(cfg, num_clients=2)
    local = RunDir(tmp_path / "local")  # eager, in-process
    run_federated("fedit", generate_suite(**DATA_OPTIONS), tiny_llama(), local.root,
                  SimConfig(RoundConfig(rounds=1)), preset("tiny"), data_spec="generated", data_options=DATA_OPTIONS)
    assert flower.read_config()["train"]["compile"] == "default"
    assert any(cache.rglob("*.py")), "no node compiled a graph"
    a = load_file(str(flower.global_adapter / "adapter_model.safetensors"))
    b = load_file(str(local.global_adapter / "adapter_model.safetensors"))
    assert set(a) == set(b) and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4  # up to float order


def test_the_run_configs_compile_is_checked_where_it_is_read() -> None:
    with pytest.raises(ValueError, match="run config's compile.*'reduce-overhead' is not offered.*CUDA graphs"):
        FlowerConfig(compile="reduce-overhead")
    with pytest.raises(ValueError, match="run config's compile: compile mode must be one of default, max-autotune"):
        FlowerConfig.from_run_config({"compile": "fast"})
    assert FlowerConfig(compile="max-autotune").compile == "max-autotune"
