"""FedAvgM, the README's worked example of adding a method: server momentum maths, two rounds, resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import tiny_llama
from training.algorithms import ALGORITHMS
from training.algorithms.fedavgm import FEDAVGM, FedAvgMStrategy
from training.data import generate_suite
from training.protocol import FitRes
from training.runtime import preset
from training.simulation import SimConfig, run_federated

REPO = Path(__file__).resolve().parents[2]
DATA = generate_suite(n_train=6, n_test=2, families=["sorting", "capitals"])


def train(out: Path, rounds: int = 2, method: str = "fedavgm", resume: bool = False, **options: float) -> RunDir:
    run_federated(method, DATA, tiny_llama(), out, SimConfig(rounds=rounds), preset("tiny"), options or None,
                  resume=resume, data_spec="generated")
    return RunDir(out)


def global_tensors(run: RunDir) -> dict[str, torch.Tensor]:
    return load_file(str(run.global_adapter / "adapter_model.safetensors"))


def test_server_momentum_step() -> None:
    strategy = FedAvgMStrategy(momentum=0.5, server_lr=2.0)
    theta = {"w": torch.zeros(2)}
    theta = strategy.aggregate(0, [FitRes("a", {"w": torch.ones(2)}, 1), FitRes("b", {"w": 3 * torch.ones(2)}, 1)],
                               [], theta)  # average 2: v = 2, theta = 0 + 2 * 2
    assert theta is not None and torch.equal(theta["w"], torch.full((2,), 4.0))
    theta = strategy.aggregate(1, [FitRes("a", {"w": torch.full((2,), 5.0)}, 1)], [], theta)  # d = 1: v = 0.5 * 2 + 1
    assert theta is not None and torch.equal(theta["w"], torch.full((2,), 8.0))
    assert strategy.aggregate(2, [], [("a", "failed")], theta) is None  # nothing to aggregate
    assert torch.equal(strategy.velocity["w"], torch.full((2,), 2.0))
    resumed = FedAvgMStrategy(momentum=0.5, server_lr=2.0)
    resumed.load_state_dict(strategy.state_dict())
    assert torch.equal(resumed.velocity["w"], strategy.velocity["w"])
    with pytest.raises(ValueError, match="0 <= momentum < 1"):
        FedAvgMStrategy(momentum=1.0)


def test_fedavgm_trains_two_rounds_and_without_momentum_is_fedavg(tmp_path: Path) -> None:
    assert ALGORITHMS["fedavgm"] is FEDAVGM
    run = train(tmp_path / "m")
    config = run.read_config()
    assert config["method"] == "fedavgm" and (run.round_dir(1) / "COMPLETE").is_file()
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [r["clients"] for r in rows if r.get("aggregate")] == [2, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    fedit = global_tensors(train(tmp_path / "fedit", method="fedit"))
    plain = global_tensors(train(tmp_path / "m0", momentum=0.0))
    for key, value in fedit.items():
        torch.testing.assert_close(plain[key], value)  # momentum 0, server_lr 1: FedAvg
    momentum = global_tensors(run)
    assert any(not torch.allclose(momentum[k], fedit[k]) for k in fedit)  # round 2 carries round 1's velocity


def test_resume_continues_the_velocity(tmp_path: Path) -> None:
    straight = global_tensors(train(tmp_path / "straight"))
    train(tmp_path / "partial", rounds=1)
    resumed = global_tensors(train(tmp_path / "partial", resume=True))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_the_readme_shows_this_file() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Adding a method", 1)[1].split("\n## ", 1)[0]
    shown = re.search(r"```python\n# training/algorithms/fedavgm\.py\n(.*?)```", section, re.S)
    assert shown is not None and shown.group(1) == (REPO / "training/algorithms/fedavgm.py").read_text()
    assert "FEDAVGM" in section and "fedmosaic train --method fedavgm" in section
