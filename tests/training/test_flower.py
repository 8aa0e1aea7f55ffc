"""FedDPA-T on Flower's simulation runtime (2 virtual SuperNodes, 2 rounds) equals the in-process run."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from fedmosaic.tiny import tiny_llama
from training.data import generate_suite
from training.flower import FlowerConfig, run_flower_simulation
from training.runtime import preset
from training.simulation import SimConfig, run_federated

DATA_OPTIONS = {"n_train": 4, "n_test": 2, "families": ["sorting", "capitals"]}


def test_feddpa_t_on_flower_simulation_matches_the_simulator(tmp_path: Path) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cfg = FlowerConfig(method="feddpa-t", data="generated", rounds=2, out=str(tmp_path / "flower"), model="tiny",
                       preset="tiny", data_options=DATA_OPTIONS)
    flower = run_flower_simulation(cfg, num_clients=2)
    local = RunDir(tmp_path / "local")
    run_federated("feddpa-t", generate_suite(**DATA_OPTIONS), tiny_llama(), local.root,
                  SimConfig(rounds=2, embed=False), preset("tiny"), data_spec="generated", data_options=DATA_OPTIONS)
    a = load_file(str(flower.global_adapter / "adapter_model.safetensors"))
    b = load_file(str(local.global_adapter / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    for client in ("sorting", "capitals"):
        fa = load_file(str(flower.local_adapter(client) / "adapter_model.safetensors"))
        fb = load_file(str(local.local_adapter(client) / "adapter_model.safetensors"))
        assert all(torch.allclose(fa[k], fb[k], atol=1e-6) for k in fa)  # private state kept on the node
        assert (Path(cfg.out) / "flower-clients" / client / "local.safetensors").is_file()  # mirrored to disk
    assert (flower.round_dir(1) / "COMPLETE").is_file()
