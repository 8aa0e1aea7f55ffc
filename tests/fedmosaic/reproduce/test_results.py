"""The committed results (``bench/results/t1-*``): their ``README.md`` and ``table1.md`` are what their cells give.

Both files are generated from the cells (``fedmosaic reproduce --tables-only``), so a cell added or changed
without rewriting them, or a hand edit, fails here; ``--tables-only`` itself rewrites a folder from its
cells without training or evaluating anything.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from fedmosaic.cli import main
from fedmosaic.reproduce import cli, results, runs, table1

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"
# each committed folder and the evaluation options its cells were made with (its README's commands say them)
FOLDERS = {"t1-dpa1": ["--ttp-limit", "50"], "t1-gen": ["--ttp-limit", "50"]}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_the_committed_tables_are_what_their_cells_give(name: str) -> None:
    out = RESULTS / name
    sub = argparse.ArgumentParser().add_subparsers()
    opts = cli.options(cli.add_reproduce_arguments(sub).parse_args([*FOLDERS[name], "--out", str(out)]))
    table = results.tabulate(out, results.with_settings(out, opts))
    rewrite = f"stale: fedmosaic reproduce --tables-only {' '.join(FOLDERS[name])} --out bench/results/{name}"
    assert (out / "table1.md").read_text() == table.markdown, rewrite
    assert (out / "README.md").read_text() == table.readme, rewrite
    assert f"--ttp-limit 50 --out runs/{name}" in table.readme  # the commands that made the cells
    assert "## Ablation: `fedoa-lambda0/`" in table.readme and "--option fedoa:lambda=0" in table.readme


def test_tables_only_rewrites_a_folder_from_its_cells_and_trains_nothing(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(*_a: object, **_k: object) -> None:
        raise AssertionError("--tables-only trained or evaluated")

    monkeypatch.setattr(runs, "train_run", nothing)
    monkeypatch.setattr(table1, "evaluate_run", nothing)
    copy = shutil.copytree(RESULTS / "t1-gen", tmp_path / "t1-gen")
    (copy / "table1.md").unlink()
    (copy / "README.md").write_text("stale")
    assert main(["reproduce", "--tables-only", "--ttp-limit", "50", "--out", str(copy)]) == 0
    for name in ("table1.md", "README.md"):
        assert (copy / name).read_text() == (RESULTS / "t1-gen" / name).read_text()
    with pytest.raises(SystemExit, match="no cell in .* was made with"):  # its cells were made with --ttp-limit 50
        main(["reproduce", "--tables-only", "--out", str(copy)])
    with pytest.raises(SystemExit, match="has no table1_settings.json"):
        main(["reproduce", "--tables-only", "--out", str(tmp_path / "empty")])


@pytest.mark.parametrize("damage", [b'{"broken', b"[1, 2]", b"\xff\xfe not utf-8"])
def test_a_damaged_cell_is_named_and_nothing_is_rewritten(tmp_path: Path, damage: bytes) -> None:
    copy = shutil.copytree(RESULTS / "t1-gen", tmp_path / "t1-gen")
    cell = sorted((copy / "cells").glob("*.json"))[0]
    cell.write_bytes(damage)
    (copy / "README.md").write_text("kept")
    with pytest.raises(SystemExit, match=f"fedmosaic reproduce: {cell}"):
        main(["reproduce", "--tables-only", "--ttp-limit", "50", "--out", str(copy)])
    assert (copy / "README.md").read_text() == "kept" and cell.read_bytes() == damage
