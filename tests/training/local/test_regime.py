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
from training.data import generate_suite
from training.local.regime import BUDGETS, COSINE_FLOOR, LR_CAP, schedule_factor
from training.local.runtime import Runtime, TrainConfig, preset
from training.local.train import train_adapters
from training.settings import method_settings

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
    assert cfg["budget"]["fraction"] == 1.0 and cfg["budget"]["lr_rule_factor"] == 1.0


# The papers' examples per client of one adapter over a run, for FedDPA's 300 examples a client: rounds x
# local epochs x 300 (FedAMoLE: rounds x 200 steps x batch 1; Centralized: 50 epochs over 8 x 300 pooled).
PAPER_EXAMPLES = {"feddpa-t": 60_000, "feddpa-f": 60_000, "fedit": 60_000, "fedlora": 60_000, "fedoa": 12_000,
                  "fedamole": 6_000, "pfedseq": 24_000, "fedmcp": 7_500, "local": 15_000, "centralized": 120_000}
SCALED = sorted(n for n in BUDGETS if n not in ("paper", "tiny"))  # tiny also caps steps: a smoke budget


@pytest.mark.parametrize("name", SCALED)
def test_examples_per_client_keep_the_papers_ratios(name: str) -> None:
    b = BUDGETS[name]
    for method, paper in PAPER_EXAMPLES.items():
        eff = method_settings(method, name)
        got = eff.budget["examples_per_client"]
        # f times the paper's, within one optimizer step per local run of rounding
        assert abs(got - b.fraction * paper) <= eff.rounds * eff.train.batch_size, (method, got)
        assert eff.budget["fraction"] == b.fraction and eff.budget["steps_per_run"] >= 1
        # rounds and local work scale together (neither is left at the paper's while the other absorbs f)
        assert eff.rounds <= PAPER[method][7] and eff.budget["epochs_per_run"] < PAPER[method][5] or method in (
            "fedamole", "fedmcp", "pfedseq")
    # so the ratios between methods are the papers' (FedDPA 10 epochs : FedOA 2 : FedMCP 1), within rounding
    ratio = lambda a, c: method_settings(a, name).budget["examples_per_client"] / method_settings(  # noqa: E731
        c, name).budget["examples_per_client"]
    assert ratio("feddpa-t", "fedoa") == pytest.approx(5.0, rel=0.1)
    assert ratio("centralized", "local") == pytest.approx(8.0, rel=0.1)
    assert ratio("fedit", "fedamole") == pytest.approx(10.0, rel=0.15)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_lr_and_schedule_follow_the_steps(name: str) -> None:
    b = BUDGETS[name]
    for method, (opt, lr, schedule, decay, batch, *_rest) in PAPER.items():
        eff = method_settings(method, name)
        assert (eff.train.optimizer, eff.train.round_decay) == (opt, decay)
        assert eff.train.batch_size == min(batch, b.max_batch or batch)
        want = 1.0 if name == "paper" else min(LR_CAP, (eff.train.batch_size / (b.fraction * batch)) ** 0.5)
        assert eff.train.lr == pytest.approx(lr * want) and eff.budget["lr"] == eff.train.lr
        assert eff.train.schedule == (schedule if name == "paper" or schedule == "constant" else "cosine")
        assert eff.train.max_grad_norm == 1.0  # the reference's Trainer clips at 1.0
    # pFedSeq's warm-up counts rounds: scaled with them, so a short run still personalises after it.
    assert method_settings("pfedseq", "paper").options["warmup"] == 10
    assert method_settings("pfedseq", "small", options={"warmup": 3}).options["warmup"] == 3
    scaled = method_settings("pfedseq", name)
    assert 1 <= scaled.options["warmup"] < scaled.rounds


def test_cosine_warms_up_then_decays_to_its_floor() -> None:
    f = [schedule_factor("cosine", s, 20) for s in range(20)]
    assert f[0] == pytest.approx(1 / 3) and f[1] == pytest.approx(2 / 3) and f[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[2:], f[3:], strict=False)) and f[-1] == pytest.approx(COSINE_FLOOR)
    assert schedule_factor("cosine", 0, 3) == 1.0  # under 10 steps: no warm-up step
    short = [schedule_factor("cosine", s, 6) for s in range(6)]
    assert short[0] == 1.0 and min(short) == pytest.approx(COSINE_FLOOR)  # a short run never trains at ~0


def test_a_budget_run_learns_what_the_tiny_model_can_learn() -> None:
    # A trivially learnable set (every response the same three words); 40 of 160 examples held out. At the
    # `small` budget (2 rounds of a quarter epoch, the step rule's lr, cosine) FedIT's local training lowers
    # the held-out loss by >= 0.15 nats; main's `small` (the paper's 3e-4, linear to 0 in 6 steps) gave 0.035.
    from training.data import ClientData, FederatedDataset, Record
    from training.data.partition import hold_out
    from training.lr_search import _trajectory, validation_loss

    recs = tuple(Record(instruction=f"Say the colour of item {i}.", input="", output="blue blue blue")
                 for i in range(160))
    client = hold_out(FederatedDataset("toy", (ClientData("a", "colour", recs),), {}), 0.25).clients[0]
    eff = method_settings("fedit", "small")
    rt = Runtime(tiny_llama(), eff.train)
    train, val = rt.examples(client), rt.examples(ClientData("a-val", "colour", client.validation))
    rt.fresh("global", 0)
    before = validation_loss(rt, val)
    after = _trajectory(rt, train, val, eff.rounds, seed=1)
    assert before - after >= 0.15, (before, after)


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
    # the step rule: 5e-4 * sqrt(B' / (f B)) = 5e-4 * sqrt(4 / (64 / 400)) = 2.5e-3
    assert (cfg["train"]["optimizer"], cfg["rounds"]) == ("adam", 1)
    assert cfg["train"]["lr"] == pytest.approx(2.5e-3) and cfg["budget"]["lr_rule_factor"] == 5.0


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


def test_feddpa2_sets_the_papers_alpha(capsys: pytest.CaptureFixture[str]) -> None:
    # paper 000 s5.1: alpha = lambda = 0.5 on data set 1, 0.3 on data set 2
    for data, alpha in (("feddpa1", 0.5), ("feddpa2", 0.3), ("generated", 0.5)):
        assert main(["train", "--method", "feddpa-t", "--data", data, "--print-config"]) == 0
        assert json.loads(capsys.readouterr().out)["options"]["alpha"] == alpha
    assert method_settings("feddpa-t", data="feddpa2", options={"alpha": 0.7}).options["alpha"] == 0.7
    m = ALGORITHMS["feddpa-t"]
    assert m.mixture_weight(m.options_for("feddpa2")) == 0.3  # the served lambda follows
    # without the data set, alpha is left for run_federated to set (a generic 0.5 would override it)
    assert "alpha" not in method_settings("feddpa-t").options


def test_fedamole_experts_scale_with_the_clients(capsys: pytest.CaptureFixture[str]) -> None:
    # paper 002: 30 experts for 10 clients (k_c = 2: 6 per client on average); 24 for 8 clients (FedDPA's
    # count, and the generated suite's, which needs no benchmark data folder)
    assert main(["train", "--method", "fedamole", "--data", "generated", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["options"]["num_experts"] == 24 and cfg["options"]["export"] == "local"
    assert method_settings("fedamole", n_clients=10).options["num_experts"] == 30
    assert "num_experts" not in method_settings("fedamole").options  # run_federated sets it for its clients


def test_max_grad_norm_clips_each_step() -> None:
    # SGD at lr 1: the update is the clipped gradient, so its norm is at most max_grad_norm
    base = TrainConfig(optimizer="sgd", lr=1.0, schedule="constant", batch_size=4, micro_batch_size=4, max_steps=1,
                       cutoff_len=64, lora=LoraConfig(dropout=0.0))
    assert base.max_grad_norm == 1.0
    moved = {}
    for clip in (1.0, 1e-3, None):
        rt = Runtime(tiny_llama(), TrainConfig(**{**base.__dict__, "max_grad_norm": clip}))
        data = generate_suite(n_train=4, n_test=1, families=["sorting"]).clients[0]
        rt.fresh("global", 0)
        with torch.no_grad():
            for p in rt.params("global").values():
                p.add_(0.05)
        before = torch.cat([v.detach().flatten().clone() for v in rt.params("global").values()])
        train_adapters(rt, rt.examples(data), ["global"], ["global"], [1.0], seed=1)
        moved[clip] = float((torch.cat([v.detach().flatten() for v in rt.params("global").values()]) - before).norm())
    assert moved[1e-3] == pytest.approx(1e-3, rel=1e-3) and moved[1.0] <= 1.0 + 1e-4
    assert moved[None] > moved[1e-3]


def test_lr_search_scores_a_validation_split_and_records_its_choice(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--method", "fedit", "--data", "generated", "--n-train", "6", "--n-test", "1",
                 "--families", "sorting,capitals", "--rounds", "1", "--out", str(out), "--model", "tiny",
                 "--preset", "tiny", "--lr-search", "0.5,2", "--lr-search-clients", "1"]) == 0
    cfg = RunDir(out).read_config()
    rule = method_settings("fedit", "tiny").train.lr
    found = cfg["lr_search"]
    assert found["lrs"] == pytest.approx([rule * 0.5, rule * 2]) and len(found["val_loss"]) == 2
    best = found["lrs"][min(range(2), key=lambda i: found["val_loss"][i])]
    assert found["lr"] == best == cfg["train"]["lr"] and len(found["clients"]) == 1
    assert "chosen" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="drop --lr"):
        main(["train", "--method", "fedit", "--model", "tiny", "--preset", "tiny", "--lr", "1e-3", "--lr-search",
              "--out", str(tmp_path / "x")])
