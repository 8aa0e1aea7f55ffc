"""FedAvgM, the docs' worked example of adding a method: server momentum maths, two rounds, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import tiny_llama
from training.algorithms import ALGORITHMS
from training.algorithms.fedavgm import FEDAVGM, FedAvgMStrategy
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import preset
from training.protocol import FitRes
from training.simulation import SimConfig, run_federated

REPO = Path(__file__).resolve().parents[3]
DATA = generate_suite(n_train=6, n_test=2, families=["sorting", "capitals"])


def train(out: Path, rounds: int = 2, method: str = "fedavgm", resume: bool = False, **options: float) -> RunDir:
    run_federated(method, DATA, tiny_llama(), out, SimConfig(RoundConfig(rounds=rounds)), preset("tiny"),
                  options or None, resume=resume, data_spec="generated")
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


def test_the_docs_show_this_file() -> None:
    page = (REPO / "docs/adding-a-method.md").read_text()
    # the whole file, included as it is (pymdownx.snippets, from the repository root) rather than copied
    assert '```python\n--8<-- "training/algorithms/fedavgm.py"\n```' in page
    assert (REPO / "training/algorithms/fedavgm.py").is_file()
    assert "FEDAVGM" in page and "fedmosaic train --method fedavgm" in page
