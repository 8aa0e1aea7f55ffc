"""Tables: every format loads to the records of its JSONL equivalent; --columns; each column error path."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from training.data import DataError, FederatedDataset, load_dataset
from training.data.tables import parse_columns

COLUMNS = "instruction=Q,input=C,output=A,client=K"
TRAIN = [{"Q": f"question {i}", "C": "" if i % 2 else f"context {i}", "A": f"answer {i}", "K": f"site {i % 3}",
          "topic": ("math", "art")[i % 2]} for i in range(12)]
TEST = [{"Q": f"test {i}", "C": "", "A": f"ref {i}", "K": "site 0", "topic": "math"} for i in range(2)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def same(a: FederatedDataset, b: FederatedDataset) -> None:
    assert a.client_ids == b.client_ids
    for x, y in zip(a.clients, b.clients, strict=True):
        assert x.train == y.train and x.task == y.task
    assert a.tests == b.tests


def test_every_format_loads_the_records_of_its_jsonl_equivalent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                ) -> None:
    import datasets
    import huggingface_hub.constants

    reference = load_dataset(str(write_jsonl(tmp_path / "ref.jsonl", TRAIN)), columns=COLUMNS)
    assert reference.client_ids == ["site_0", "site_1", "site_2"]  # plain names for the run directory
    first = reference.clients[0].train[0]
    assert (first.instruction, first.input, first.output, first.task) == ("question 0", "context 0", "answer 0",
                                                                          "site 0")
    assert sum(len(c.train) for c in reference.clients) == 12 and reference.tests == {}
    (tmp_path / "list.json").write_text(json.dumps(TRAIN))
    singles = [tmp_path / "list.json", write_csv(tmp_path / "t.csv", TRAIN),
               write_csv(tmp_path / "t.tsv", TRAIN, "\t")]
    datasets.Dataset.from_list(TRAIN).to_parquet(str(tmp_path / "t.parquet"))
    singles.append(tmp_path / "t.parquet")
    for path in singles:
        same(load_dataset(str(path), columns=COLUMNS), reference)

    # with a test split: a folder's test* files, a save_to_disk DatasetDict, a Hub data set's cached files
    with_tests = load_dataset(str(write_jsonl(tmp_path / "jl" / "train.jsonl", TRAIN).parent), columns=COLUMNS)
    write_jsonl(tmp_path / "jl" / "test.jsonl", TEST)
    with_tests = load_dataset(str(tmp_path / "jl"), columns=COLUMNS)
    assert [r.instruction for r in with_tests.tests["site 0"]] == ["test 0", "test 1"]
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list(TRAIN).to_parquet(str(tmp_path / "pq" / "train-00000.parquet"))
    datasets.Dataset.from_list(TEST).to_parquet(str(tmp_path / "pq" / "test-00000.parquet"))
    write_csv(tmp_path / "csvs" / "train.csv", TRAIN)
    write_csv(tmp_path / "csvs" / "test.csv", TEST)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN), "test": datasets.Dataset.from_list(TEST)}
                         ).save_to_disk(str(tmp_path / "disk"))
    hub = tmp_path / "hub"
    snapshot = hub / "datasets--someone--qa" / "snapshots" / "0123abcd"
    write_jsonl(snapshot / "data" / "train.jsonl", TRAIN)
    write_jsonl(snapshot / "data" / "test.jsonl", TEST)
    (hub / "datasets--someone--qa" / "refs").mkdir()
    (hub / "datasets--someone--qa" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    for spec in (tmp_path / "pq", tmp_path / "csvs", tmp_path / "disk", "someone/qa", "hf:someone/qa"):
        same(load_dataset(str(spec), columns=COLUMNS), with_tests)
    with pytest.raises(DataError, match=r"'someone/other' is not a file or folder, and not a data set in the local "
                                        r"Hugging Face cache .*never downloads at run time"):
        load_dataset("someone/other", columns=COLUMNS)


def test_columns_roles_and_defaults(tmp_path: Path) -> None:
    assert parse_columns("instruction=Q, output=A") == {"instruction": "Q", "output": "A"}
    for bad, message in (("answer=A", "unknown role 'answer'; the roles are instruction, input, output"),
                         ("output", "expects ROLE=COLUMN items, got 'output'"), ("output=A,output=B", "twice")):
        with pytest.raises(DataError, match=message):
            parse_columns(bad)
    # columns named after their roles need no mapping; no client column: one client per task
    rows = [{"instruction": f"q{i}", "output": f"a{i}", "task": ("x", "y")[i % 2]} for i in range(4)]
    ds = load_dataset(str(write_csv(tmp_path / "plain.csv", rows)))
    assert ds.client_ids == ["x", "y"] and ds.task_of("y") == "y" and len(ds.client("x").train) == 2


def test_each_column_error_names_the_file_the_column_and_what_was_found(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "qa.csv", TRAIN)
    with pytest.raises(DataError, match=r"qa.csv: --columns output=Answr names column 'Answr', which is not there; "
                                        r"columns found: \['Q', 'C', 'A', 'K', 'topic'\]"):
        load_dataset(str(path), columns="instruction=Q,output=Answr")
    with pytest.raises(DataError, match=r"qa.csv: no 'instruction' column; columns found: \['Q', 'C', 'A', 'K', "
                                        r"'topic'\]; name the column .* --columns instruction=COLUMN"):
        load_dataset(str(path), columns="output=A")
    empty = write_csv(tmp_path / "empty.csv", [{**r, "A": ""} for r in TRAIN])
    with pytest.raises(DataError, match=r"empty.csv: column 'A' \(output\) is empty in every row"):
        load_dataset(str(empty), columns=COLUMNS)
    holes = write_csv(tmp_path / "holes.csv", [{**r, "Q": "" if i in (2, 5) else r["Q"]} for i, r in enumerate(TRAIN)])
    with pytest.raises(DataError, match=r"holes.csv: column 'Q' \(instruction\) is empty in 2 of 12 rows "
                                        r"\(rows 3, 6\)"):
        load_dataset(str(holes), columns=COLUMNS)
    semicolons = write_csv(tmp_path / "semi.csv", TRAIN, ";")
    with pytest.raises(DataError, match=r"semi.csv: read as one column 'Q;C;A;K;topic' with the ',' delimiter, but "
                                        r"the header holds ';': a wrong delimiter\?"):
        load_dataset(str(semicolons), columns=COLUMNS)
    with pytest.raises(DataError, match=r"qa.csv: --by subject names column 'subject', which is not there"):
        load_dataset(str(path), columns=COLUMNS, partition="iid", clients=2, by="subject")
    no_client = write_csv(tmp_path / "flat.csv", [{"Q": "q", "A": "a"}])
    with pytest.raises(DataError, match=r"flat.csv: no client column and no task column .*--partition iid"):
        load_dataset(str(no_client), columns="instruction=Q,output=A")
    folder = tmp_path / "json_folder"
    write_jsonl(folder / "train" / "c.jsonl", [{"instruction": "q", "output": "a"}])
    with pytest.raises(DataError, match="--columns maps a table's columns; .* is a folder of JSON client files"):
        load_dataset(str(folder), columns="output=A")
    (tmp_path / "bad.jsonl").write_text('{"Q": "x"\n')
    with pytest.raises(DataError, match=r"bad.jsonl cannot be read: "):
        load_dataset(str(tmp_path / "bad.jsonl"), columns=COLUMNS)


def test_train_refuses_a_bad_column_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import models
    from fedmosaic.cli import main

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the data was checked")

    monkeypatch.setattr(models, "load_base_model", no_model)
    path = write_csv(tmp_path / "qa.csv", TRAIN)
    argv = ["train", "--method", "fedit", "--model", "tiny", "--data", str(path), "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match=r"fedmosaic train: .*qa.csv: --columns output=Nope names column 'Nope'"):
        main([*argv, "--columns", "instruction=Q,output=Nope"])
    with pytest.raises(SystemExit, match=r"fedmosaic train: .*qa.csv: --columns output=Nope names column 'Nope'"):
        main([*argv, "--columns", "instruction=Q,output=Nope", "--print-config"])  # not swallowed by --print-config
    with pytest.raises(SystemExit, match="--by and --clients choose how --partition splits the rows"):
        main([*argv, "--columns", COLUMNS, "--by", "topic"])
    with pytest.raises(SystemExit, match="--partition and --clients-per-task both make clients"):
        main([*argv, "--columns", COLUMNS, "--partition", "iid", "--clients", "2", "--clients-per-task", "2"])
    assert not (tmp_path / "run").exists()
