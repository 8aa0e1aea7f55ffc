"""Test sets other than the run's own: the forms ``fedmosaic eval --test`` reads, and its up-front checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmosaic.evaluation.testsets import TestSet, check_test_set, load_test_set, slug, spec_name
from training.data import DataError, Record


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(task: str | None, n: int, output: str | None = "x") -> list[dict]:
    out = []
    for i in range(n):
        row: dict = {"instruction": f"q{i}"}
        if task is not None:
            row["task"] = task
        if output is not None:
            row["output"] = output
        out.append(row)
    return out


def test_the_forms_a_test_set_takes(tmp_path: Path) -> None:
    # the generic layout: test/<task>.jsonl (train/ is not read), named after the folder
    write_jsonl(tmp_path / "heldout" / "test" / "qa.jsonl", rows(None, 2))
    write_jsonl(tmp_path / "heldout" / "test" / "mixed.jsonl", [*rows("nli", 1), *rows("qa", 1)])
    (tmp_path / "heldout" / "train").mkdir()
    (tmp_path / "heldout" / "train" / "broken.jsonl").write_text("{not json\n")
    for spec in (tmp_path / "heldout", tmp_path / "heldout" / "test"):
        ts = load_test_set(str(spec))
        assert ts.name == "heldout" and ts.source == str(spec)
        assert ts.tasks == ["nli", "qa"] and len(ts.tests["qa"]) == 3  # a record's task field wins over its file
    # a folder of task files (a FedDPA folder's *test*.jsonl included), and one file
    write_jsonl(tmp_path / "flat" / "flan_test.jsonl", [*rows("a", 2), *rows("b", 1)])
    (tmp_path / "flat" / "8").mkdir()  # FedDPA's training folder beside it is not read
    assert load_test_set(str(tmp_path / "flat")).tasks == ["a", "b"]
    one = load_test_set(str(tmp_path / "flat" / "flan_test.jsonl"))
    assert one.name == "flan_test" and one.tasks == ["a", "b"]
    generated = load_test_set("generated")
    assert generated.name == "generated" and "sorting" in generated.tasks
    with pytest.raises(DataError, match="neither"):
        load_test_set(str(tmp_path / "nowhere"))
    assert spec_name("feddpa2") == "feddpa2" and slug("my tasks/v2") == "my-tasks-v2" and slug("..") == "test"


def test_checks_refuse_an_unusable_test_set_naming_the_problem(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no task"):
        check_test_set(load_test_set(str(tmp_path / "empty")), "rouge1", None)
    write_jsonl(tmp_path / "blank.jsonl", [])
    with pytest.raises(DataError, match="holds no task"):
        check_test_set(load_test_set(str(tmp_path / "blank.jsonl")), "rouge1", None)
    # references missing (no field) or empty: the metric is named, and so is every task short of them
    write_jsonl(tmp_path / "noref" / "a.jsonl", [*rows(None, 2), *rows(None, 2, output=None)])
    write_jsonl(tmp_path / "noref" / "b.jsonl", rows(None, 1, output=" "))
    noref = load_test_set(str(tmp_path / "noref"))
    with pytest.raises(DataError, match=r"metric 'exact' .* 3 examples have none \(a: 2, b: 1\)"):
        check_test_set(noref, "exact", None)
    with pytest.raises(DataError, match=r"1 examples have none \(b: 1\)"):
        check_test_set(noref, "rouge1", 2)  # only the examples the evaluation uses are checked
    check_test_set(TestSet("ok", None, {"a": (Record("q", "a"),)}), "rouge1", None)
