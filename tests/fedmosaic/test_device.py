"""The device setting across the commands: every --device option, the serve and Flower configs, what runs record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedmosaic.cli import main
from models import tiny_llama


@pytest.fixture()
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch report one CUDA device (only the resolution logic runs; nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("command", [["train", "--method", "fedit", "--out", "x"], ["eval", "x"], ["serve"],
                                     ["batch", "-i", "a", "-o", "b"], ["quickstart"], ["generate", "hi"]])
def test_every_command_takes_device_and_refuses_a_bad_one(command: list[str], capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main([*command, "--device", "gpu"])
    assert "--device must be auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*command, "--device", "cuda:1"])
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_generate_runs_on_the_chosen_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "tiny", str(tmp_path / "tiny")]) == 0
    assert main(["generate", "hello", "--model", str(tmp_path / "tiny"), "--adapter", "random:0.5",
                 "--max-new-tokens", "2", "--dtype", "float32", "--device", "cpu"]) == 0
    capsys.readouterr()


def test_serve_settings_and_the_flower_config_carry_a_checked_device(one_gpu: None) -> None:
    del one_gpu
    from pydantic import ValidationError

    from serving.settings import ServeSettings
    from serving.stack import stack_config
    from training.flower.app import FlowerConfig, client_resources

    assert ServeSettings().device is None
    assert stack_config(ServeSettings(device="cuda:0")).device == "cuda:0"
    with pytest.raises(ValidationError):
        ServeSettings(device="gpu")
    assert FlowerConfig.from_run_config({"device": "cpu"}).device == "cpu"
    assert FlowerConfig.from_run_config({"device": ""}).device == ""  # pyproject's default: each node decides
    with pytest.raises(ValueError, match="Flower run config's device must be auto, cpu, cuda or cuda:N"):
        FlowerConfig(device="gpu")
    # Ray hides GPUs from actors asking for none: on CUDA every virtual node asks for its share
    assert client_resources(FlowerConfig(device="cuda"), 8) == {"num_cpus": 1, "num_gpus": 0.125}
    assert client_resources(FlowerConfig(device="cuda"), 3)["num_gpus"] * 3 <= 1.0
    assert client_resources(FlowerConfig(device="cpu"), 8) == {"num_cpus": 1, "num_gpus": 0.0}


def test_pyproject_declares_the_flower_device_key_and_the_cuda_marker() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["tool"]["flwr"]["app"]["config"]["device"] == ""
    assert any(m.startswith("cuda:") for m in project["tool"]["pytest"]["ini_options"]["markers"])
    assert "test-gpu:" in (root / "Makefile").read_text()


def test_a_run_records_its_device(tmp_path: Path) -> None:
    from training.data import generate_suite
    from training.federation.rounds import RoundConfig
    from training.local.runtime import preset
    from training.simulation import SimConfig, run_federated

    data = generate_suite(seed=0, n_train=4, n_test=1, families=["date_format", "sorting"])
    run_federated("fedit", data, tiny_llama(), tmp_path / "run", SimConfig(RoundConfig(rounds=1), embed=False),
                  preset("tiny", max_steps=1))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["device"] == "cpu"


def test_make_test_gpu_puts_a_built_mamba_ssm_on_the_path(tmp_path: Path) -> None:
    """pFedSeq's kernel test runs under ``make test-gpu`` once ../shared/gpu/mamba_ssm.sh built the package."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[2]

    def command(target: Path) -> str:
        done = subprocess.run(["make", "-n", "-s", "test-gpu", f"MAMBA_SSM={target}"], cwd=root, check=True,
                              capture_output=True, text=True)
        return done.stdout

    (tmp_path / "built" / "mamba_ssm").mkdir(parents=True)
    assert f'PYTHONPATH="{tmp_path / "built"}' in command(tmp_path / "built")
    assert str(tmp_path / "missing") not in command(tmp_path / "missing")
