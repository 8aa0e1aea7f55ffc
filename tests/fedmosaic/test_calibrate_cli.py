"""Calibrations written at the end of training, rebuilt by ``fedmosaic calibrate``, chosen by option."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adapters.rundir import RunDir
from fedmosaic.cli import main
from fedmosaic.evaluation.evaluate import EvalOptions, EvalSetupError
from fedmosaic.evaluation.stack_backend import open_backend
from routing.calibration import CALIBRATION_FILE, Calibration, fingerprint
from serving.cli import add_serve_arguments, settings_from_args
from serving.settings import ServeSettings
from serving.stack import stack_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    out = tmp_path_factory.mktemp("cal") / "run"
    assert main(["train", "--method", "feddpa-t", "--data", "generated", "--n-train", "6", "--n-test", "2",
                 "--families", "sorting,capitals", "--rounds", "1", "--out", str(out), "--model", "tiny",
                 "--preset", "tiny"]) == 0
    return RunDir(out)


def test_training_writes_each_clients_calibration_beside_its_index(run: RunDir) -> None:
    for client in run.clients():
        cal = Calibration.load(run.client_dir(client))
        assert cal is not None and cal.fingerprint == fingerprint(np.load(run.embeddings(client)))
        assert cal.summary["n_instances"] == 6 and cal.summary["background_id"].startswith("generic-v1:")
        assert cal.statistic == "mahalanobis" and len(cal.own_scores) == 6 and 0.0 < cal.shrinkage <= 1.0
        assert json.loads((run.client_dir(client) / CALIBRATION_FILE).read_text())["format"] == 3


def test_calibrate_command_rebuilds_the_same_calibration(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    before = {c: Calibration.load(run.client_dir(c)) for c in run.clients()}
    for c in run.clients():
        (run.client_dir(c) / CALIBRATION_FILE).unlink()  # a run trained before calibrations existed
    assert main(["calibrate", str(run.root), "--dtype", "float32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == set(run.clients())
    for c, old in before.items():
        new = Calibration.load(run.client_dir(c))
        assert old is not None and new is not None and new.fingerprint == old.fingerprint
        assert new.own == pytest.approx(old.own, rel=1e-4) and new.background == pytest.approx(old.background, rel=1e-4)
        np.testing.assert_allclose(new.center, old.center, atol=1e-4)
        np.testing.assert_allclose(new.own_scores, old.own_scores, rtol=1e-4)
        assert new.shrinkage == pytest.approx(old.shrinkage, rel=1e-6)
    # the first calibrated rule on request: a centroid ramp, no held-out scores
    assert main(["calibrate", str(run.root), "--dtype", "float32", "--statistic", "centroid"]) == 0
    capsys.readouterr()
    centroid = Calibration.load(run.client_dir(run.clients()[0]))
    assert centroid is not None and centroid.statistic == "centroid" and centroid.own_scores == ()
    assert main(["calibrate", str(run.root), "--dtype", "float32"]) == 0  # back to the default for the tests below
    capsys.readouterr()


def test_gate_needs_a_run_trained_with_held_out_examples(run: RunDir) -> None:
    before = {c: (run.client_dir(c) / CALIBRATION_FILE).read_bytes() for c in run.clients()}
    with pytest.raises(SystemExit, match=r"^fedmosaic calibrate: .* without held-out examples: --gate needs"):
        main(["calibrate", str(run.root), "--gate"])
    assert before == {c: (run.client_dir(c) / CALIBRATION_FILE).read_bytes() for c in run.clients()}  # untouched


def test_calibrate_command_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "adapters" / "clients" / "a").mkdir(parents=True)
    (empty / "run.json").write_text(json.dumps({"method": "feddpa-t", "model": "tiny"}))
    with pytest.raises(SystemExit, match="no embedding index"):
        main(["calibrate", str(empty)])
    with pytest.raises(SystemExit, match="background-quantile"):
        main(["calibrate", str(empty), "--background-quantile", "2"])
    with pytest.raises(SystemExit):
        main(["calibrate", str(empty), "--statistic", "median"])


def test_eval_option_errors_and_choices(run: RunDir, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["eval", str(run.root), "--feddpa-weighting", "tuned"])
    with pytest.raises(ValueError, match="feddpa_weighting"):
        EvalOptions(feddpa_weighting="tuned")
    with pytest.raises(ValueError, match="contradicts"):
        EvalOptions(feddpa_weights="fixed", feddpa_weighting="calibrated")
    cfg = run.read_config()
    assert open_backend(run, cfg, dtype="float32").stack.info["feddpa_weighting"] == "calibrated"  # the default
    paper = open_backend(run, cfg, dtype="float32", rule="paper").stack
    assert paper.routing == "instance" and paper.info["feddpa_weighting"] == "paper"
    assert open_backend(run, cfg, dtype="float32", rule="fixed").stack.routing == "fixed"
    # a run without calibrations: asking for calibrated names the command; the default falls back to paper
    old = RunDir(tmp_path / "old")
    import shutil

    shutil.copytree(run.root, old.root)
    for c in old.clients():
        (old.client_dir(c) / CALIBRATION_FILE).unlink()
    with pytest.raises(EvalSetupError, match="fedmosaic calibrate"):
        open_backend(old, cfg, dtype="float32", rule="calibrated")
    with pytest.raises(SystemExit, match="^fedmosaic eval: calibrated FedDPA weights need"):  # one line, no traceback
        main(["eval", str(old.root), "--model", "tiny", "--dtype", "float32", "--feddpa-weighting", "calibrated"])
    assert open_backend(old, cfg, dtype="float32").stack.info["feddpa_weighting"] == "paper"


def test_serve_option_env_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_arguments(sub)
    default = ServeSettings().feddpa_options()
    assert (default.instance, default.rule) == (True, "calibrated")
    args = parser.parse_args(["serve", "--feddpa-weighting", "paper"])
    assert stack_config(settings_from_args(args)).feddpa.rule == "paper"
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_WEIGHTING", "fixed")
    assert not stack_config(settings_from_args(parser.parse_args(["serve"]))).feddpa.instance
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_WEIGHTING", "tuned")
    with pytest.raises(ValueError, match="feddpa_weighting"):
        ServeSettings()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--feddpa-weighting", "tuned"])
    monkeypatch.delenv("FEDMOSAIC_SERVE_FEDDPA_WEIGHTING")
    config = stack_config(settings_from_args(parser.parse_args(
        ["serve", "--feddpa-samples", "3", "--feddpa-mode", "knn", "--max-decode-skips", "0"])))
    assert (config.feddpa.samples, config.feddpa.mode, config.engine.max_decode_skips) == (3, "knn", 0)
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_SAMPLES", "2")  # the environment applies when the option is left out
    assert stack_config(settings_from_args(parser.parse_args(["serve"]))).feddpa.samples == 2
    with pytest.raises(SystemExit, match="feddpa_samples"):
        settings_from_args(parser.parse_args(["serve", "--feddpa-samples", "0"]))
