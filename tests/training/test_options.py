"""Method options are checked against each method's declaration: on the command line, in the Flower run config
and in the Python API, before anything trains."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from fedmosaic.cli import main
from models import tiny_llama
from training.algorithms import ALGORITHMS, get_method
from training.data.generated import generate_suite
from training.flower.app import FlowerConfig
from training.local.runtime import preset
from training.options import Option, OptionError
from training.settings import method_settings
from training.simulation import run_federated

ROOT = Path(__file__).resolve().parents[2]


def train_error(*argv: str) -> str:
    """The one-line error ``fedmosaic train`` exits with."""
    with pytest.raises(SystemExit) as info:
        main(["train", *argv, "--print-config"])
    return str(info.value)


def test_a_typo_names_the_closest_option_and_every_valid_one() -> None:
    message = train_error("--method", "feddpa-t", "--option", "alhpa=0.3")
    assert message.startswith("fedmosaic train: --option: feddpa-t has no option 'alhpa' (did you mean 'alpha'?)")
    for name in ("alpha", "mu", "local_from", "weighting", "clip_norm", "aggregator", "trim"):
        assert name in message


def test_a_key_with_nothing_close_lists_the_options_without_a_guess() -> None:
    message = train_error("--method", "fedprox", "--option", "zzz=1")
    assert "did you mean" not in message and "its options: aggregator, clip_norm, mu, trim, weighting" in message
    message = train_error("--method", "local", "--option", "alpha=0.3")
    assert "local has no option 'alpha'; it takes no options" in message


@pytest.mark.parametrize(("argv", "expected"), [
    (("--method", "feddpa-t", "--option", "alpha=high"), "alpha must be a number in [0, 1], got 'high'"),
    (("--method", "feddpa-t", "--option", "alpha=1.5"), "alpha must be a number in [0, 1], got 1.5"),
    (("--method", "feddpa-t", "--option", "local_from=2"), "local_from must be one of 0, 1, got 2"),
    (("--method", "fedit", "--option", "weighting=size"), "weighting must be one of 'equal', 'num_examples'"),
    (("--method", "fedavgm", "--option", "momentum=1"), "momentum must be a number in [0, 1), got 1"),
    (("--method", "fedavgm", "--option", "server_lr=0"), "server_lr must be a number > 0, got 0"),
    (("--method", "fedit", "--option", "clip_norm=-1"), "clip_norm must be a number > 0 or null, got -1"),
    (("--method", "fedamole", "--option", "top_k=1.5"), "top_k must be an integer >= 1, got 1.5"),
    (("--method", "pfedseq", "--option", "aggregation=1"), "aggregation must be true or false, got 1"),
    (("--method", "fedprox", "--option", "mu=NaN"), "mu must be a number >= 0, got nan"),
])
def test_a_bad_value_names_the_expected_type_and_range(argv: tuple[str, ...], expected: str) -> None:
    assert expected in train_error(*argv)


def test_valid_options_print_as_given_over_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--method", "feddpa-t", "--option", "alpha=0.3", "--option", "local-from=1",
                 "--print-config"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert options == {"alpha": 0.3, "mu": 0.0, "local_from": 1, "weighting": "equal"}  # a dash read as _
    assert "given twice" in train_error("--method", "fedoa", "--option", "local_from=1", "--option", "local-from=0")


def test_help_options_lists_every_declared_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--method", "fedmcp", "--help-options"]) == 0
    out = capsys.readouterr().out
    for option in get_method("fedmcp").options:
        assert f"  {option.name}: " in out
    assert "gamma: a number in [0, 1]; default 0.5." in out and "weighting" not in out  # FedMCP fixes it


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_method_s_defaults_validate_and_build_its_halves(name: str) -> None:
    m = get_method(name)
    m.check_options(m.defaults)
    m.check_options({o.name: o.default for o in m.options})  # the unlisted ones' defaults too
    opts = {**m.defaults, "seed": 0}
    m.strategy(opts)
    m.client(opts)
    assert len({o.name for o in m.options}) == len(m.options)


def test_declared_defaults_lie_in_their_own_ranges() -> None:
    option = Option("x", float, 2.0, "", low=0, high=1)
    assert option.problem(option.default) == "2.0"
    for m in ALGORITHMS.values():
        assert all(o.problem(o.default) is None for o in m.options), m.name


def test_the_python_api_rejects_an_unknown_option_before_touching_the_disk(tmp_path: Path) -> None:
    data = generate_suite(n_train=2, n_test=1, families=["sorting"])
    with pytest.raises(OptionError, match="fedprox has no option 'mu_' \\(did you mean 'mu'\\?\\)"):
        run_federated("fedprox", data, tiny_llama(), tmp_path / "run", 1, preset("tiny"), {"mu_": 0.1})
    assert not (tmp_path / "run").exists()


def test_the_settings_the_harness_trains_with_are_checked_too() -> None:
    with pytest.raises(OptionError, match="pfedseq's option warmup must be an integer >= 0, got -1"):
        method_settings("pfedseq", "small", options={"warmup": -1})
    assert method_settings("pfedseq", "small", options={"warmup": 3}).options["warmup"] == 3


def test_the_flower_run_config_rejects_an_unknown_key_and_an_unknown_option() -> None:
    with pytest.raises(ValueError, match="no key 'rouns' \\(did you mean 'rounds'\\?\\); its keys: .*clients-per-task"):
        FlowerConfig.from_run_config({"method": "fedit", "rouns": 2})
    with pytest.raises(OptionError, match="the Flower run config's options: feddpa-t has no option 'alhpa'"):
        FlowerConfig.from_run_config({"method": "feddpa-t", "options": '{"alhpa": 0.3}'})
    with pytest.raises(ValueError, match="options must be a JSON object"):
        FlowerConfig.from_run_config({"options": "[1]"})
    assert FlowerConfig.from_run_config({"method": "feddpa-t", "options": '{"alpha": 0.3}'}).options == {"alpha": 0.3}


def test_the_shipped_flower_config_reads_back() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert FlowerConfig.from_run_config(declared).method == declared["method"]


def test_the_reproduction_harness_checks_every_method_s_options_before_training(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="fedmosaic reproduce: --option: fedit has no option 'weightin' \\(did you "
                                         "mean 'weighting'\\?\\)"):
        main(["reproduce", "--methods", "fedit,local", "--option", "fedit:weightin=equal", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_data_and_client_count_defaults_validate_too() -> None:
    for m in ALGORITHMS.values():
        for defaults in m.data_defaults.values():
            m.check_options(defaults)
        if m.client_defaults is not None:
            m.check_options(m.client_defaults(8))
