"""--partition: flwr-datasets' partitioners from the command line, seeds, sizes, histograms, split.json read back."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from training.data import DataError, histogram, load_dataset, load_run_dataset, parse_partition, read_split
from training.data.partitioners import assign

LABELS = ["math"] * 60 + ["art"] * 30 + ["geo"] * 20 + ["law"] * 10  # 120 rows, skewed label counts


def write_table(path: Path, n: int = 120) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["Question", "Answer", "topic"])
        writer.writeheader()
        writer.writerows({"Question": f"q{i}", "Answer": f"a{i}", "topic": LABELS[i % len(LABELS)]} for i in range(n))
    return path


def rows(scheme: str, seed: int, clients: int | None = 4, by: str | None = "topic") -> dict[str, tuple[int, ...]]:
    return assign(parse_partition(scheme, by, clients, seed), LABELS, len(LABELS))


def test_partition_flags_are_checked() -> None:
    for text, by, clients, message in (("random", None, 4, "expected iid | dirichlet:ALPHA | shard:K | column"),
                                       ("dirichlet:-1", "t", 4, "ALPHA > 0"), ("dirichlet", "t", 4, "ALPHA > 0"),
                                       ("dirichlet:inf", "t", 4, "finite ALPHA"),
                                       ("shard:0", "t", 4, "integer K >= 1"), ("iid:3", None, 4, "iid \\(no argument"),
                                       ("dirichlet:0.5", None, 4, "needs --by COLUMN"),
                                       ("iid", None, None, "needs --clients N"),
                                       ("column", "t", 3, "one client per value of --by; drop --clients")):
        with pytest.raises(DataError, match=message):
            parse_partition(text, by, clients)
    with pytest.raises(DataError, match="--clients 200 is more than the 120 training rows"):
        rows("iid", 0, clients=200, by=None)
    with pytest.raises(DataError, match=r"shard:5 with 30 clients needs at least 150 rows \(one a shard\); there are"):
        rows("shard:5", 0, clients=30)
    with pytest.raises(DataError, match=r"cannot split 120 rows into 60 clients \(use a larger ALPHA or fewer"):
        rows("dirichlet:0.01", 0, clients=60)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "shard:2"])
def test_same_seed_same_split_another_seed_another(scheme: str) -> None:
    by = None if scheme == "iid" else "topic"
    first = rows(scheme, 7, by=by)
    assert first == rows(scheme, 7, by=by)
    assert first != rows(scheme, 8, by=by)


def test_sizes_and_label_histograms_of_each_scheme() -> None:
    totals = Counter(LABELS)
    iid = rows("iid", 0, by=None)
    assert sorted(i for r in iid.values() for i in r) == list(range(120))  # every row once
    assert [len(r) for r in iid.values()] == [30, 30, 30, 30]
    column = rows("column", 0, clients=None)
    assert {c: Counter(LABELS[i] for i in r) for c, r in column.items()} == {t: Counter({t: n}) for t, n in
                                                                            totals.items()}
    shard = rows("shard:1", 0)  # one label-sorted shard of 30 rows a client: at most 2 labels in each
    assert [len(r) for r in shard.values()] == [30, 30, 30, 30]
    assert all(len({LABELS[i] for i in r}) <= 2 for r in shard.values())
    for alpha in ("0.3", "1000"):
        d = rows(f"dirichlet:{alpha}", 3)
        assert sorted(i for r in d.values() for i in r) == list(range(120))
        assert sum(Counter(LABELS[i] for i in r)["math"] for r in d.values()) == 60

    def skew(alpha: str) -> float:  # the mean share of a client's most common label, over seeds
        shares = [max(Counter(LABELS[i] for i in r).values()) / len(r) for s in range(5)
                  for r in rows(f"dirichlet:{alpha}", s).values()]
        return float(np.mean(shares))

    assert skew("0.3") > skew("1000") + 0.1 and abs(skew("1000") - 0.5) < 0.05  # large alpha: the pool's 0.5


def test_partition_of_a_table_and_of_a_benchmark_folder(tmp_path: Path) -> None:
    path = write_table(tmp_path / "qa.csv")
    ds = load_dataset(str(path), columns="instruction=Question,output=Answer", partition="dirichlet:0.5", by="topic",
                      clients=4, partition_seed=1)
    assert ds.split is not None and ds.split.partition["scheme"] == "dirichlet" and ds.split.pooled == 120
    hist = histogram(ds)
    assert sum(sum(h.values()) for h in hist.values()) == 120
    assert all(ds.client(c).task == h.most_common(1)[0][0] for c, h in hist.items())  # a client's task: its label
    for c in ds.clients:  # each client's rows are the table's rows the split names, in table order
        assert [r.instruction for r in c.train] == [f"q{i}" for i in ds.split.rows[c.client_id]]
    folder = tmp_path / "feddpa"
    (folder / "8").mkdir(parents=True)
    for k, task in enumerate(("snli", "cola")):
        (folder / "8" / f"local_training_{k}.json").write_text(json.dumps(
            [{"instruction": f"{task} {j}", "output": "o", "task": task} for j in range(10)]))
    (folder / "test.jsonl").write_text(json.dumps({"instruction": "t", "output": "o", "task": "snli"}) + "\n")
    iid = load_dataset(str(folder), partition="iid", clients=4, partition_seed=0)
    assert [len(c.train) for c in iid.clients] == [5, 5, 5, 5] and set(iid.tests) == {"snli"}
    by_task = load_dataset(str(folder), partition="column", by="task")
    assert by_task.client_ids == ["cola", "snli"] and len(by_task.client("cola").train) == 10
    with pytest.raises(DataError, match="--by topic: .* have the fields task, category and client"):
        load_dataset(str(folder), partition="column", by="topic")


def test_data_show_prints_each_clients_size_and_histogram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedmosaic.cli import main

    path = write_table(tmp_path / "qa.csv")
    argv = ["data", "show", str(path), "--columns", "instruction=Question,output=Answer", "--partition", "shard:1",
            "--by", "topic", "--clients", "4", "--n", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "qa: 4 clients, partition shard:1, by topic, clients 4, seed 0"
    assert out[1].split() == ["client", "train", "topic", "histogram"]
    expected = rows("shard:1", 0)
    for line, (client, picked) in zip(out[2:], expected.items(), strict=True):
        counts = Counter(LABELS[i] for i in picked)
        assert line.split()[:2] == [client, "30"]
        assert line.split(None, 2)[2] == ", ".join(f"{k} {v}" for k, v in sorted(counts.items(),
                                                                                 key=lambda kv: (-kv[1], kv[0])))


def test_the_split_is_written_to_the_run_and_read_back_by_eval_calibration_and_serving(tmp_path: Path) -> None:
    from adapters.rundir import RunDir
    from fedmosaic.cli import main
    from fedmosaic.evaluation.inputs import load_inputs

    (tmp_path / "qa").mkdir()
    path = write_table(tmp_path / "qa" / "train.csv", n=24).parent
    write_table(tmp_path / "qa" / "test.csv", n=4)  # a test split
    out = tmp_path / "run"
    assert main(["train", "--method", "feddpa-t", "--data", str(path), "--columns",
                 "instruction=Question,output=Answer", "--partition", "dirichlet:0.5", "--by", "topic", "--clients",
                 "3", "--seed", "5", "--rounds", "1",
                 "--model", "tiny", "--preset", "tiny", "--out", str(out)]) == 0
    run = RunDir(out)
    cfg = run.read_config()
    assert cfg["data_options"] == {"columns": {"instruction": "Question", "output": "Answer"},
                                   "partition": "dirichlet:0.5", "by": "topic", "clients": 3, "partition_seed": 5}
    recorded = read_split(out)
    assert recorded is not None and sorted(i for r in recorded.values() for i in r) == list(range(24))
    assert json.loads((out / "split.json").read_text())["partition"]["alpha"] == 0.5
    # serving's FedDPA clients: one adapter folder and one instance per training row of each split client
    assert run.clients() == sorted(recorded)
    for client, picked in recorded.items():
        assert np.load(run.embeddings(client)).shape[0] == len(picked)
    # evaluation and calibration reload exactly these clients, even where the partitioner would now differ
    reloaded = load_run_dataset(cfg, run_dir=out)
    assert {c.client_id: [r.instruction for r in c.train] for c in reloaded.clients} == {
        c: [f"q{i}" for i in picked] for c, picked in recorded.items()}
    swapped = {"0": recorded["1"], "1": recorded["0"], "2": recorded["2"]}  # a split no seed of this code makes
    (out / "split.json").write_text(json.dumps({"partition": {"scheme": "dirichlet"}, "pooled": 24,
                                                "clients": swapped}))
    dataset, _ = load_inputs(run, cfg, data=None, test=None, metric="rouge-l", limit=None)
    assert {c.client_id: [r.instruction for r in c.train] for c in dataset.clients} == {
        c: [f"q{i}" for i in picked] for c, picked in swapped.items()}
    (out / "split.json").write_text(json.dumps({"partition": {}, "pooled": 3, "clients": {"0": [99]}}))
    with pytest.raises(DataError, match="client '0'.s row 99 is outside the 24 training rows"):
        load_run_dataset(cfg, run_dir=out)
