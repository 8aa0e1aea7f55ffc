"""``fedmosaic eval RUN --test FOLDER``: a tiny FedDPA run scored on tasks its clients never saw (issue 20).

The run's clients are ``sorting`` and ``capitals`` (generated suite, seed 0). Held-out folders come
from the same generator with another seed, so no test example is a training one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from adapters.rundir import RunDir
from fedmosaic.cli import main
from fedmosaic.evaluation.backend import EvalItem
from fedmosaic.evaluation.compare import compare_runs
from fedmosaic.evaluation.evaluate import EvalOptions, EvalSetupError, evaluate_run
from fedmosaic.evaluation.predictions import Prediction
from tests.fedmosaic.evaluation.test_evaluate import build_run
from training.data import DataError, write_suite

FAST = ["--limit", "2", "--max-new-tokens", "2", "--batch-size", "4", "--dtype", "float32"]


def held_out(root: Path, families: Sequence[str], train: Sequence[str] = ()) -> Path:
    """A generic-layout folder: ``test/`` holds ``families``, ``train/`` the clients ``train`` (may be none)."""
    folder = write_suite(root, seed=1, n_train=1, n_test=2, families=sorted({*families, *train}))
    for family in {*families, *train}:
        if family not in families:
            (folder / "test" / f"{family}.jsonl").unlink()
        if family not in train:
            (folder / "train" / f"{family}.jsonl").unlink()
    return folder


def test_unseen_tasks_write_table_json_and_plots(tmp_path: Path) -> None:
    run = build_run(tmp_path, embeddings=True)  # FedDPA-T with its index: instance-wise weights
    folder = held_out(tmp_path / "heldout", ["arithmetic", "unit_conversion"])
    assert main(["eval", str(run.root), "--test", str(folder), "--per-round", *FAST]) == 0
    out = run.eval_dir / "test-sets" / "heldout"
    res = json.loads((out / "results.json").read_text())
    assert res["options"]["test"] == str(folder) and res["test_set"]["name"] == "heldout"
    assert res["test_set"]["tasks"] == {"arithmetic": 2, "unit_conversion": 2}
    assert res["test_set"]["clients_without_own_task"] == ["sorting", "capitals"]
    assert res["test_set"]["clients_with_own_task"] == [] and res["test_set"]["duplicates"] == 0
    # no client's task is present: the Personalization block is left out, TTP covers the given tasks
    assert list(res["tables"]) == ["ttp"]
    ttp = res["tables"]["ttp"][0]
    scores = res["scores"]["sorting"]
    assert ttp["values"]["sorting"] == pytest.approx((scores["arithmetic"]["rouge1"]
                                                      + scores["unit_conversion"]["rouge1"]) / 2)
    md = (out / "table.md").read_text()
    assert md.startswith("FedDPA-T on test set heldout (from ") and "2 tasks: arithmetic, unit_conversion" in md
    assert "**Personalization**" not in md and "Personalization omitted" in md
    # every task is "other" for every client: statistics and the plot say so
    weights = res["feddpa_weights"]
    assert weights["unseen_tasks"] == ["arithmetic", "unit_conversion"] and weights["own_client"] == {"n": 0}
    assert weights["other_clients"]["n"] == 2 * 2 * 2  # clients x tasks x examples
    assert all(0.0 <= a <= 1.0 for per in weights["per_client"].values() for a in per.values())
    for png in ("scores.png", "feddpa_weights.png", "rounds.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "1" in res["per_round"]
    assert not (run.eval_dir / "results.json").exists()  # the run's own evaluation is another folder
    # --compare on that test set names it
    md = compare_runs([run.root, run.root], metric="rouge1", test=str(folder / "test"))
    assert md.startswith("Runs on test set heldout") and md.count("| FedDPA-T |") == 2
    with pytest.raises(EvalSetupError, match="no evaluation on test set"):
        compare_runs([run.root], test="generated")


def test_issue_crash_data_folder_whose_tests_are_other_tasks(tmp_path: Path) -> None:
    """The issue's report: ``--data FOLDER`` (train/ = the run's clients, test/ = other tasks) died in the table."""
    run = build_run(tmp_path)
    folder = held_out(tmp_path / "other", ["arithmetic"], train=["sorting", "capitals"])
    summary = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32", data=str(folder)))
    assert list(summary["tables"]) == ["ttp"] and summary["test_set"]["name"] == "other"
    assert summary["test_set"]["source"] == str(folder)  # --data's own test sets
    assert (run.eval_dir / "table.md").read_text().startswith(f"FedDPA-T on test set other (from {folder}; 1 tasks")
    own = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32"))
    assert own["test_set"]["source"] is None and own["markdown"].startswith(
        "FedDPA-T on test set generated-s0 (the run's own; 2 tasks: capitals, sorting)")
    assert own["test_set"]["clients_with_own_task"] == ["sorting", "capitals"] and "personalization" in own["tables"]


def test_mixed_some_clients_own_tasks_present(tmp_path: Path) -> None:
    run = build_run(tmp_path, embeddings=True)
    folder = held_out(tmp_path / "mixed", ["capitals", "arithmetic"])
    summary = evaluate_run(run.root, EvalOptions(limit=2, max_new_tokens=2, batch_size=4, dtype="float32",
                                                 test=str(folder)))
    ts = summary["test_set"]
    assert ts["clients_with_own_task"] == ["capitals"] and ts["clients_without_own_task"] == ["sorting"]
    assert ts["tasks_no_client_trained_on"] == ["arithmetic"]
    pers = summary["tables"]["personalization"][0]
    own = summary["scores"]["capitals"]["capitals"]["rouge1"]
    assert pers["values"] == {"sorting": None, "capitals": pytest.approx(own)} and pers["avg"] == pytest.approx(own)
    md = summary["markdown"]
    assert "| FedDPA-T | n/a |" in md and "the own task of sorting (sorting) is not in the test set" in md
    weights = summary["feddpa_weights"]
    assert weights["per_task_own_client"]["capitals"]["n"] == 2 and weights["per_task_other_clients"]["capitals"][
        "n"] == 2
    assert weights["unseen_tasks"] == ["arithmetic"] and weights["per_task_other_clients"]["arithmetic"]["n"] == 4
    # the predictions live beside this test set's outputs, not in the run's own cache
    assert (run.eval_dir / "test-sets" / "mixed" / "predictions" / "final" / "sorting" / "capitals.jsonl").is_file()
    assert not (run.eval_dir / "predictions").exists()


class NoGeneration:
    """A backend that fails the test if anything is generated (checks must come first)."""

    base_name = "base"

    def models(self) -> list[str]:
        return ["base", "global"]

    def describe(self, target: str) -> dict:
        return {"target": target}

    def generate(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, Prediction]]:
        raise AssertionError(f"generated {len(items)} items before the options were checked")


def test_bad_options_are_refused_before_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = build_run(tmp_path)
    (tmp_path / "empty" / "test").mkdir(parents=True)
    noref = tmp_path / "noref.jsonl"
    noref.write_text(json.dumps({"instruction": "2 + 2?", "task": "arithmetic"}) + "\n")
    cases = [(["--test", str(tmp_path / "empty")], "test set 'empty' .* holds no task"),
             (["--test", str(noref)], "metric 'rouge1' scores answers against reference outputs, but 1 examples"),
             (["--test", str(tmp_path / "missing")], "is neither"),
             (["--data", str(held_out(tmp_path / "strangers", [], train=["arithmetic"]))], "none of .* --data"),
             (["--limit", "0"], "limit must be >= 1, got 0"),
             (["--batch-size", "0"], "batch_size must be >= 1, got 0")]
    for args, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["eval", str(run.root), *FAST, *args])  # args last: they override FAST
        text = str(exc.value.code)
        assert text.startswith("fedmosaic eval: ") and "\n" not in text
        assert re.search(message, text), text
    bare = RunDir(tmp_path / "bare")  # a run directory whose training wrote no adapter
    bare.root.mkdir()
    bare.run_json.write_text(run.run_json.read_text())
    with pytest.raises(EvalSetupError, match="has no clients to evaluate"):
        evaluate_run(bare.root, EvalOptions(), backend=NoGeneration())  # type: ignore[arg-type]
    with pytest.raises(DataError, match="holds no task"):
        evaluate_run(run.root, EvalOptions(test=str(tmp_path / "empty")), backend=NoGeneration())  # type: ignore[arg-type]
    assert not run.eval_dir.exists() and not bare.eval_dir.exists()  # nothing written, nothing generated
