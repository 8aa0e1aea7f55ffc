"""LoRA settings for every method: ``--lora-r/--lora-alpha/--lora-dropout/--target-modules``, shown by
``--print-config``, trained with, and recorded in run.json and each adapter's (or AMoLE model's) config,
which PEFT reads. One non-default setting per method family on the tiny model (one round)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from peft import PeftConfig, PeftModel
from safetensors.torch import load_file

from adapters import LoraConfig
from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_llama
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import TrainConfig, preset
from training.settings import method_settings
from training.simulation import SimConfig, run_federated

DATA = generate_suite(n_train=4, n_test=1, families=["sorting", "capitals"])
# per method family a LoRA the paper never used: MLP and attention, a regex, all-linear, two odd names
SETTINGS = {
    "feddpa-t": LoraConfig(r=2, alpha=4.0, dropout=0.1, target_modules="all-linear"),
    "fedamole": LoraConfig(r=3, alpha=9.0, dropout=0.0, target_modules=r".*\.(self_attn\.o|mlp\.up)_proj"),
    "pfedseq": LoraConfig(r=4, alpha=4.0, dropout=0.0, target_modules=("q_proj", "k_proj", "down_proj")),
    "fedmcp": LoraConfig(r=2, alpha=2.0, dropout=0.2, target_modules="all-linear"),
    "fedoa": LoraConfig(r=1, alpha=3.0, dropout=0.0, target_modules=("k_proj", "gate_proj")),
}
MODULES = {  # Linear modules per decoder layer each setting adapts on the tiny model
    "feddpa-t": 7, "fedamole": 2, "pfedseq": 3, "fedmcp": 7, "fedoa": 2,
}


def test_print_config_shows_the_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--method", "fedit", "--model", "tiny", "--print-config", "--lora-r", "16",
                 "--lora-alpha", "32", "--lora-dropout", "0", "--target-modules", "all-linear"]) == 0
    lora = json.loads(capsys.readouterr().out)["train"]["lora"]
    assert lora == {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear", "use_rslora": False}
    assert main(["train", "--method", "fedit", "--model", "tiny", "--print-config",
                 "--target-modules", "q_proj, o_proj"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["lora"]["target_modules"] == ["q_proj", "o_proj"]
    for flags, reason in ((["--lora-r", "0"], "r must be a positive integer"),
                          (["--lora-dropout", "1"], "dropout must be in"),
                          (["--lora-alpha", "-2"], "alpha must be a positive number")):
        with pytest.raises(SystemExit, match=reason):
            main(["train", "--method", "fedit", "--model", "tiny", "--print-config", *flags])
    with pytest.raises(SystemExit):  # argparse: "not a valid regular expression"
        main(["train", "--method", "fedit", "--model", "tiny", "--print-config", "--target-modules", "(q"])
    assert "not a valid regular expression" in capsys.readouterr().err


def test_method_settings_and_run_json_round_trip() -> None:
    eff = method_settings("fedoa", "tiny", lora_r=5, lora_alpha=10.0, target_modules=r".*q_proj")
    assert (eff.train.lora.r, eff.train.lora.alpha, eff.train.lora.target_modules) == (5, 10.0, r".*q_proj")
    assert eff.train.lora.dropout == LoraConfig().dropout
    assert TrainConfig.from_dict(json.loads(json.dumps(eff.train.asdict()))) == eff.train


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_each_method_family_trains_and_records_a_non_default_lora(method: str, tmp_path: Path) -> None:
    lora = SETTINGS[method]
    train = replace(preset("tiny"), lora=lora, max_steps=1)
    options = {"num_experts": 2, "max_experts": 2} if method == "fedamole" else None
    run_federated(method, DATA, tiny_llama(), tmp_path / "run", SimConfig(RoundConfig(rounds=1)), train, options)
    run = RunDir(tmp_path / "run")
    assert run.read_config()["train"]["lora"] == lora.asdict()
    if method == "fedamole":
        folders = [run.amole]
        raw = json.loads((run.amole / "amole_config.json").read_text())["lora"]
    else:
        folders = [run.global_adapter] + [run.local_adapter(c) for c in DATA.client_ids
                                          if run.local_adapter(c).is_dir()]
        raw = json.loads((run.global_adapter / "adapter_config.json").read_text())
    got, want = LoraConfig.from_peft_dict(raw), lora.target_modules
    assert (got.r, got.alpha, got.dropout) == (lora.r, lora.alpha, lora.dropout)
    assert got.target_modules == (want if isinstance(want, str) else tuple(sorted(want)))  # PEFT's: names sorted
    for folder in folders:
        weights = next(folder.glob("*.safetensors"))
        a_keys = [k for k, v in load_file(str(weights)).items() if ".lora_A" in k]
        assert len(a_keys) == MODULES[method] * 2 * (3 if method == "fedamole" else 1)  # 2 layers (x experts)
        assert all(v.shape[0] == lora.r for k, v in load_file(str(weights)).items() if ".lora_A" in k)
    if method != "fedamole":  # PEFT reads the folder and builds the same modules
        assert PeftConfig.from_pretrained(str(run.global_adapter)).r == lora.r
        peft = PeftModel.from_pretrained(tiny_llama().model, str(run.global_adapter))
        assert sum(1 for n, _ in peft.named_modules() if n.endswith("lora_A.default")) == MODULES[method] * 2
