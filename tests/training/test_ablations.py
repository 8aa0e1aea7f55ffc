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


def test_fedamole_a_trains_evaluates_and_serves_with_its_vanilla_router(tmp_path: Path) -> None:
    """Paper 002 s5.5's FedAMoLE-A: a vanilla MoLE router (one row per assignable expert) in place of the
    token projection, recorded in the exported folder, routed with by evaluation and serving alike."""
    from safetensors.torch import load_file

    out = tmp_path / "amole-a"
    assert main(["train", "--method", "fedamole", *DATA, "--rounds", "2", "--out", str(out), "--option",
                 "router=vanilla", "--option", "num_experts=3", "--option", "max_experts=3"]) == 0
    run = RunDir(out)
    assert run.read_config()["options"]["router"] == "vanilla"
    assert json.loads((run.amole / "amole_config.json").read_text())["router"] == "vanilla"
    routers = [v for k, v in load_file(str(run.amole / "amole_model.safetensors")).items() if "token_proj" in k]
    assert routers and {tuple(v.shape[:1]) for v in routers} == {(3,)}  # (N_e, d), not (r, d)
    # RSEA scored round 1 from the uploaded mean router logits: one score per (expert, client), not random
    scores = json.loads((run.round_dir(0) / "strategy.json").read_text())["scores"]
    assert scores and all(len(rows) == 3 and all(len(r) == 3 for r in rows) for rows in scores.values())

    assert main(["eval", str(out), "--limit", "1", "--max-new-tokens", "2"]) == 0
    results = json.loads((run.eval_dir / "results.json").read_text())
    assert {results["targets"][c]["mode"] for c in ("sorting", "capitals", "date_format")} == {"amole"}

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"model": c, "prompt": "Sort: b, a", "max_tokens": 2, "temperature": 0}) + "\n"
                           for c in ("sorting", "capitals")))
    assert main(["batch", "-i", str(src), "-o", str(dst), str(out), "--model", "tiny", "--backend", "torch",
                 "--no-progress"]) == 0
    answers = [json.loads(x)["response"] for x in dst.read_text().splitlines()]
    assert [a["status_code"] for a in answers] == [200, 200]
    infos = [a["body"]["fedmosaic"]["info"] for a in answers]
    assert [(i["client"], i["router"], i["num_experts"]) for i in infos] == [("sorting", "vanilla", 3),
                                                                               ("capitals", "vanilla", 3)]
