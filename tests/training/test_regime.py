"""Each method's paper regime: its defaults, the budgets that scale it, the CLI and run.json that show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters import LoraConfig
from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_llama
from training.algorithms import ALGORITHMS
from training.cli import method_settings
from training.data import generate_suite
from training.local_train import train_adapters
from training.regime import BUDGETS
from training.runtime import Runtime, TrainConfig, preset

# The papers' numbers (README "Training settings per method"), written out here rather than read from the
# modules, so a change to a module's regime fails this test: (optimizer, lr, schedule, decay, batch, epochs,
# steps, rounds).
PAPER = {
    "feddpa-t": ("adamw", 3e-4, "linear", 1.0, 32, 10, None, 20),
    "feddpa-f": ("adamw", 3e-4, "linear", 1.0, 32, 10, None, 20),
    "fedit": ("adamw", 3e-4, "linear", 1.0, 32, 10, None, 20),
    "fedlora": ("adamw", 3e-4, "linear", 1.0, 32, 10, None, 20),
    "fedoa": ("adamw", 3e-4, "linear", 1.0, 32, 2, None, 20),
    "fedamole": ("adam", 5e-5, "constant", 0.99, 1, 1, 200, 30),
    "pfedseq": ("sgd", 0.005, "constant", 1.0, 32, 1, None, 80),
    "fedmcp": ("adam", 5e-4, "constant", 1.0, 64, 1, None, 25),
    "local": ("adamw", 3e-4, "linear", 1.0, 32, 50, None, 1),  # paper 000 App. B: 50 epochs, no rounds
    "centralized": ("adamw", 3e-4, "linear", 1.0, 32, 50, None, 1),
}


def _row(cfg: dict) -> tuple:
    t = cfg["train"]
    return (t["optimizer"], t["lr"], t["schedule"], t["round_decay"], t["batch_size"], t["local_epochs"],
            t["max_steps"], cfg["rounds"])


@pytest.mark.parametrize("method", sorted(PAPER))
def test_print_config_shows_each_papers_regime(method: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--method", method, "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert _row(cfg) == PAPER[method]
    assert cfg["preset"] == "paper" and cfg["regime"]["source"]


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_budgets_scale_the_budget_and_keep_the_regime(name: str) -> None:
    for method in PAPER:
        eff = method_settings(method, name)
        opt, lr, schedule, decay, batch, _, steps, rounds = PAPER[method]
        b = BUDGETS[name]
        assert (eff.train.optimizer, eff.train.lr, eff.train.schedule, eff.train.round_decay) == (opt, lr, schedule,
                                                                                                   decay)
        assert eff.train.batch_size == min(batch, b.max_batch or batch)
        assert eff.train.micro_batch_size <= eff.train.batch_size
        if b.max_steps is not None:
            assert eff.train.max_steps == min(steps or b.max_steps, b.max_steps)
        scaled = max(b.min_rounds, -(-rounds * b.rounds_scale // 1))
        assert eff.rounds == (rounds if name == "paper" else min(rounds, scaled))
    # pFedSeq's warm-up counts rounds: scaled with them, so a short run still personalises after it.
    assert method_settings("pfedseq", "paper").options["warmup"] == 10
    small = method_settings("pfedseq", "small")
    assert small.options["warmup"] == 1 and small.rounds == 8
    assert method_settings("pfedseq", "small", options={"warmup": 3}).options["warmup"] == 3


def test_command_line_overrides_the_regime(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--method", "fedamole", "--preset", "small", "--print-config", "--lr", "1e-4",
                 "--optimizer", "sgd", "--lr-decay", "0.5", "--schedule", "linear", "--rounds", "4",
                 "--batch-size", "2"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert _row(cfg)[:5] == ("sgd", 1e-4, "linear", 0.5, 2) and cfg["rounds"] == 4
    assert cfg["regime"]["lr"] == 5e-5  # the paper's value is still shown beside the override
    with pytest.raises(ValueError, match="optimizer"):
        method_settings("fedit", "tiny", optimizer="lion")


def test_run_json_records_the_effective_settings(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--method", "fedmcp", "--data", "generated", "--n-train", "4", "--n-test", "1",
                 "--families", "sorting,capitals", "--rounds", "1", "--out", str(out), "--model", "tiny",
                 "--preset", "tiny"]) == 0
    cfg = RunDir(out).read_config()
    assert cfg["preset"] == "tiny" and cfg["regime"]["optimizer"] == "adam"
    assert (cfg["train"]["optimizer"], cfg["train"]["lr"], cfg["rounds"]) == ("adam", 5e-4, 1)


def _sgd_step(round_idx: int, decay: float, schedule: str = "constant", steps: int = 1) -> torch.Tensor:
    """Change of the local adapter's B after ``steps`` SGD steps at round ``round_idx`` (no dropout, same batch)."""
    train = TrainConfig(optimizer="sgd", lr=0.1, schedule=schedule, round_decay=decay, batch_size=4,
                        micro_batch_size=4, max_steps=steps, cutoff_len=64, lora=LoraConfig(dropout=0.0))
    rt = Runtime(tiny_llama(), train)
    data = generate_suite(n_train=4, n_test=1, families=["sorting"]).clients[0]
    rt.fresh("local", 0)
    with torch.no_grad():  # B != 0 so that A gets gradients too
        for p in rt.params("local").values():
            p.add_(0.01)
    before = {k: v.detach().clone() for k, v in rt.params("local").items()}
    train_adapters(rt, rt.examples(data), ["local"], ["local"], [1.0], seed=1, round_idx=round_idx)
    return torch.cat([(rt.params("local")[k].detach() - before[k]).flatten() for k in before])


def test_round_decay_scales_the_round_learning_rate() -> None:
    first, third = _sgd_step(0, 0.5), _sgd_step(2, 0.5)
    assert first.abs().sum() > 0
    torch.testing.assert_close(third, first * 0.25, rtol=1e-4, atol=1e-8)
    assert TrainConfig(lr=1.0, round_decay=0.99).round_lr(-1) == 1.0  # a final fine-tune trains at round 0's lr


def test_linear_schedule_decays_inside_a_local_run() -> None:
    # Two steps: the linear schedule's second step runs at lr * (1 - 1/2), the constant one at lr.
    one = _sgd_step(0, 1.0, "linear", steps=1)
    two_linear, two_constant = _sgd_step(0, 1.0, "linear", steps=2), _sgd_step(0, 1.0, "constant", steps=2)
    assert not torch.allclose(two_linear, two_constant)
    # the first step is the same in both; the linear run's second step is smaller than the constant run's
    assert (two_linear - one).norm() < (two_constant - one).norm()


def test_legacy_preset_is_feddpas_regime() -> None:
    assert preset("small") == method_settings("fedit", "small").train
    assert preset("tiny", max_steps=1).max_steps == 1
    assert set(ALGORITHMS) >= set(PAPER)
