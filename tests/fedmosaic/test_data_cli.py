"""``fedmosaic data``: the catalogue of loadable data sets and formatted examples, errors for unknown names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmosaic.cli import main


def fake_feddpa(root: Path) -> Path:
    """A two-client FedDPA dataset 1 in the benchmark layout (``feddpa/dataset1/8/...``) under ``root``."""
    folder = root / "feddpa" / "dataset1"
    (folder / "8").mkdir(parents=True)
    for i, task in enumerate(("cola", "snli")):
        records = [{"instruction": f"{task} question {j}", "output": f"answer {j}", "task": task} for j in range(4)]
        (folder / "8" / f"local_training_{i}.json").write_text(json.dumps(records))
    tests = [{"instruction": f"test {t} {j}", "output": "x", "task": t} for t in ("cola", "snli") for j in range(2)]
    (folder / "test_set.jsonl").write_text("\n".join(json.dumps(r) for r in tests) + "\n")
    return root


def test_list_shows_every_data_set_with_counts_or_why_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FEDMOSAIC_DATA_DIR", str(fake_feddpa(tmp_path)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert f"benchmark data folder: {tmp_path}" in out
    generated = out.split("generated:")[1].split("feddpa1:")[0]
    assert "sorting          sorting            300    50" in generated
    assert "8 clients, 8 test tasks, 2400 training and 400 test examples" in generated
    feddpa1 = out.split("feddpa1:")[1].split("feddpa2:")[0]
    assert "0       cola      4     2" in feddpa1 and "1       snli      4     2" in feddpa1
    assert "2 clients, 2 test tasks, 8 training and 4 test examples" in feddpa1
    feddpa2 = out.split("feddpa2:")[1].split("dolly:")[0]
    assert "not available:" in feddpa2 and "'feddpa2' is not in" in feddpa2
    assert "not available:" in out.split("dolly:")[1]


def test_show_prints_a_few_formatted_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FEDMOSAIC_DATA_DIR", str(fake_feddpa(tmp_path)))
    assert main(["data", "show", "feddpa1", "--client", "1", "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("== feddpa1 | client 1 | task snli | example") == 2 and "client 0" not in out
    assert "### Instruction:\nsnli question 1\n\n### Response:\nanswer 1" in out
    assert main(["data", "show", "generated", "--n", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("== generated-s0 | client") == 8 and "| example 1 of 300 ==" in out


def test_unknown_names_and_clients_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDMOSAIC_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match="fedmosaic data: unknown data set 'nope'"):
        main(["data", "show", "nope"])
    with pytest.raises(SystemExit, match=r"fedmosaic data: benchmark data 'feddpa1' is not in .*dataset1"):
        main(["data", "show", "feddpa1"])
    with pytest.raises(SystemExit, match=r"has no client 'zzz'; clients: \['date_format'"):
        main(["data", "show", "generated", "--client", "zzz"])
    with pytest.raises(SystemExit, match="--n must be >= 0"):
        main(["data", "show", "generated", "--n", "-1"])
    with pytest.raises(SystemExit):
        main(["data"])  # an action is required


def test_list_without_a_data_folder_says_how_to_set_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("FEDMOSAIC_DATA_DIR", raising=False)  # no default folder beside the checkout
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # and nothing fetched
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "benchmark data folder: none (run `fedmosaic data fetch NAME`" in out
    assert f"data cache (fedmosaic data fetch): {tmp_path}/fedmosaic/data" in out
    feddpa1 = out.split("feddpa1:")[1].split("feddpa2:")[0]
    assert "not available: benchmark data 'feddpa1' is not in" in feddpa1
    assert "run `fedmosaic data fetch feddpa1`" in feddpa1
    assert "generated:" in out and "not available" not in out.split("generated:")[1].split("feddpa1:")[0]
