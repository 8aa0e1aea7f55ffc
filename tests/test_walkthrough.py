"""A user's own material from a fresh directory: a CSV with custom column names -> partitioned training.

What a newcomer does first: write a CSV whose columns have their own names, look at the split
``fedmosaic data show`` would make, and train FedDPA-T on it with a Dirichlet split by topic, all through
the ``fedmosaic`` command, with relative paths from an empty working directory (the tiny random model).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from fedmosaic.cli import main

TOPICS = ("cooking", "travel", "finance")
COLUMNS = "instruction=question,input=context,output=answer"


def write_faq(path: Path, n: int) -> None:
    """A CSV as a user would have it: their own column names, a topic per row, an optional context."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["question", "context", "answer", "topic"])
        writer.writeheader()
        for i in range(n):
            topic = TOPICS[i % 3] if i % 5 else TOPICS[0]  # cooking the largest topic
            writer.writerow({"question": f"{topic} question {i}?", "context": "" if i % 2 else f"note {i}",
                             "answer": f"{topic} answer {i}", "topic": topic})


def test_a_csv_with_its_own_column_names_trains_clients_split_by_topic(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDMOSAIC_DATA_DIR", raising=False)
    Path("faq").mkdir()
    write_faq(Path("faq/train.csv"), 36)
    write_faq(Path("faq/test.csv"), 6)
    split = ["--partition", "dirichlet:0.5", "--by", "topic", "--clients", "3", "--seed", "1"]

    assert main(["data", "show", "faq", "--columns", COLUMNS, *split, "--n", "1"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("faq: 3 clients, partition dirichlet:0.5, by topic, clients 3, seed 1\n")
    assert "### Instruction:\n" in shown and "### Input:\n" in shown  # the prompt training will use

    assert main(["train", "--method", "feddpa-t", "--data", "faq", "--columns", COLUMNS, *split,
                 "--rounds", "1", "--model", "tiny", "--preset", "tiny", "--out", "runs/faq"]) == 0
    run = Path("runs/faq")
    recorded = json.loads((run / "split.json").read_text())
    assert recorded["partition"] == {"scheme": "dirichlet", "by": "topic", "clients": 3, "seed": 1, "alpha": 0.5,
                                     "shards": None}
    rows = recorded["clients"]
    assert sorted(i for r in rows.values() for i in r) == list(range(36))  # every row in exactly one client
    table = shown.split("\n\n")[0].splitlines()[2:]  # data show's table is the split training made
    for line, (client, picked) in zip(table, rows.items(), strict=True):
        assert line.split()[:2] == [client, str(len(picked))]
        assert np.load(run / "adapters" / "clients" / client / "embeddings.npy").shape[0] == len(picked)
