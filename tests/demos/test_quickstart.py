"""``fedmosaic quickstart`` on the tiny model: trains, evaluates, serves, starts the demo, answers; reuses runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedmosaic.cli import build_parser
from fedmosaic.quickstart import default_out, describe_route, run_quickstart
from tests.demos.conftest import QUICKSTART_ARGS, REPO, Stack, quickstart_env


def quickstart(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "fedmosaic.cli", "quickstart", *QUICKSTART_ARGS, *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=quickstart_env(),
                          stdin=subprocess.DEVNULL, check=False)


def test_first_run_trains_evaluates_serves_and_answers_personalised(stack: Stack) -> None:
    text = stack.output()
    for line in ("1/4 base model: tiny", "2/4 training feddpa-t on 'generated'", "training: done",
                 "3/4 evaluation", "evaluation: done", "4/4 serving"):
        assert f"[quickstart] {line}" in text, text[-3000:]
    assert "feddpa-t rounds" in text  # training's progress bar reached the terminal
    sample = next(line for line in text.splitlines() if "[quickstart]   weighting:" in line)
    # training wrote each client's calibration, and calibrated weighting is the server's default (#19)
    assert "FedDPA weight a = " in sample and "instance-wise, calibrated" in sample and "background" in sample
    assert json.loads((stack.out / "summary.json").read_text())["rounds"] == 2
    clients = sorted(p.parent.name for p in (stack.out / "adapters" / "clients").glob("*/local"))
    assert len(clients) == 8 and "sorting" in clients
    assert (stack.out / "eval" / "table.md").is_file() and (stack.out / "eval" / "results.json").is_file()


def test_second_run_reuses_training_and_evaluation(stack: Stack) -> None:
    metrics = (stack.out / "metrics.jsonl").read_text()
    done = quickstart("--out", str(stack.out), "--no-serve")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"reusing the finished run in {stack.out}" in done.stdout
    assert "3/4 evaluation: reusing" in done.stdout and "fedmosaic serve" in done.stdout
    assert (stack.out / "metrics.jsonl").read_text() == metrics  # nothing retrained


def test_exit_after_ready_serves_answers_and_stops(stack: Stack) -> None:
    done = quickstart("--out", str(stack.out), "--no-demo", "--port", "0", "--exit-after-ready")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[quickstart]   weighting: FedDPA weight a = " in done.stdout
    assert "[quickstart] stopped (--exit-after-ready)" in done.stdout
    assert "[quickstart] demo " not in done.stdout


def _run(argv: list[str]) -> int:
    return run_quickstart(build_parser().parse_args(["quickstart", *argv]))


def test_refuses_another_run_and_too_few_rounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"method": "fedit", "data": "generated", "model": "tiny"}))
    assert _run(["--model", "tiny", "--out", str(run), "--no-serve"]) == 1
    out = capsys.readouterr().out
    assert "holds another run" in out and "'method': 'fedit'" in out and "pass --out" in out
    assert _run(["--model", "tiny", "--out", str(tmp_path / "new"), "--rounds", "1", "--no-serve"]) == 1
    assert "--rounds 2 or more" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()


def test_default_run_dirs_and_route_line() -> None:
    assert default_out("generated") == Path("runs/quickstart")
    assert default_out("feddpa1") == Path("runs/quickstart-feddpa1")
    assert default_out("/data/mine/") == Path("runs/quickstart-mine")
    line = describe_route({"mode": "feddpa", "weights": {"global": 0.6, "x:local": 0.4},
                           "info": {"a": 0.4, "mean_similarity": 0.8, "S": 5, "lambda": 0.5}})
    assert line.startswith("FedDPA weight a = 0.400") and "S = 5" in line and "x:local 0.400" in line
    assert describe_route({"mode": "adapter", "weights": {"global": 1.0}, "info": {}}) == "mode adapter: global 1.000"
    calibrated = describe_route({"mode": "feddpa", "weights": {"global": 0.75, "x:local": 0.25},
                                 "info": {"weighting": "calibrated", "score": 0.4, "own": 0.5, "background": 0.3,
                                          "lambda": 0.5, "a": 0.25}})
    assert calibrated.startswith("FedDPA weight a = 0.250 (instance-wise, calibrated: score 0.400 between "
                                 "background 0.300 and own 0.500, lambda 0.5)")
