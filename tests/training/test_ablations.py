"""The papers' ablations reached from ``fedmosaic train`` (tiny model, one or two rounds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.rundir import RunDir
from fedmosaic.cli import main

DATA = ["--data", "generated", "--n-train", "4", "--n-test", "1", "--families", "sorting,capitals,date_format",
        "--model", "tiny", "--preset", "tiny"]


def test_fedoa_leave_one_task_out_trains_without_the_task_and_evaluates_it(tmp_path: Path) -> None:
    out = tmp_path / "loo"
    assert main(["train", "--method", "fedoa", *DATA, "--rounds", "2", "--leave-out", "capitals",
                 "--out", str(out)]) == 0
    run = RunDir(out)
    assert run.read_config()["data_options"]["leave_out"] == ["capitals"]
    assert sorted(run.clients()) == ["date_format", "sorting"]  # nobody trained the held-out task
    assert main(["eval", str(out), "--limit", "1", "--max-new-tokens", "2"]) == 0
    results = json.loads((run.eval_dir / "results.json").read_text())
    ood = results["ood"]
    assert ood["held_out"] == ["capitals"]
    for target, mean in ood["mean"].items():  # one held-out task: the mean is that task's score
        assert mean == pytest.approx(results["scores"][target]["capitals"]["rouge1"])
    assert {"global", "sorting", "date_format"} <= set(ood["mean"])
    assert "Out of distribution" in (run.eval_dir / "table.md").read_text()


@pytest.mark.parametrize("method,option,key", [
    ("feddpa-t", "mu=0.01", "mu"),  # FedDPA inside FedProx (paper 000 Table 8)
    ("feddpa-f", "mu=0.01", "mu"),
    ("fedmcp", "similarity=cosine", "similarity"),  # cosine instead of CKA (paper 004 s4.4)
    ("fedamole", "export=local", "export"),
])
def test_ablation_options_run_from_the_command_line(tmp_path: Path, method: str, option: str, key: str) -> None:
    out = tmp_path / method
    extra = ["--option", "num_experts=3", "--option", "max_experts=3"] if method == "fedamole" else []
    assert main(["train", "--method", method, *DATA, "--rounds", "2", "--out", str(out), "--option", option,
                 *extra]) == 0
    run = RunDir(out)
    assert str(run.read_config()["options"][key]) == option.split("=", 1)[1]
    if method == "fedamole":
        assert all((run.client_dir(c) / "amole" / "assignments.json").is_file()
                   for c in ("sorting", "capitals", "date_format"))
