"""Durable files: a crash at any write leaves either the old or the new content; a torn journal row is cut;
a file that no longer reads back as written makes its round no resume point; and a real run crashed at
EVERY write point (each file, folder and journal row it writes, torn as a crash leaves it) resumes to
exactly the adapters and metrics rows of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import tiny_llama
from training.data import generate_suite
from training.federation import durable
from training.federation.checkpoint import COMPLETE, last_complete
from training.federation.rounds import RoundConfig
from training.local.runtime import preset
from training.simulation import SimConfig, run_federated


class Crash(BaseException):
    """The process dies here (BaseException: no client-error handler swallows it)."""


class Injector:
    """Counts durable write points; at number ``at`` leaves that write torn and crashes."""

    def __init__(self, at: int = 0) -> None:
        self.at, self.count = at, 0

    def commit(self, tmp: Path, path: Path) -> None:
        self.count += 1
        if self.count == self.at:  # what a kill leaves: a half-written temporary beside the untouched target
            torn = tmp.parent / f"{durable.TMP_PREFIX}torn-{path.name}"
            if tmp.is_dir():
                shutil.copytree(tmp, torn)
                for f in torn.rglob("*"):
                    if f.is_file():
                        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            else:
                torn.write_bytes(tmp.read_bytes()[: tmp.stat().st_size // 2])
            raise Crash(f"write point {self.count}: {path}")
        os.replace(tmp, path)

    def append(self, fh: Any, data: bytes) -> None:
        self.count += 1
        if self.count == self.at:  # a row cut mid-line
            fh.write(data[: len(data) // 2])
            fh.flush()
            raise Crash(f"write point {self.count}: a journal row")
        fh.write(data)


def test_a_crash_before_the_rename_keeps_the_old_file_and_no_temporary(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.json"
    durable.write_json(path, {"v": 1})
    monkeypatch.setattr(durable, "_commit", Injector(at=1).commit)
    with pytest.raises(Crash):
        durable.write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in durable.leftovers(tmp_path)] == [".tmp-torn-run.json"]  # only the simulated kill's


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "global"
    durable.write_folder(dest, lambda d: (d / "a.txt").write_text("old"))
    monkeypatch.setattr(durable, "_commit", Injector(at=1).commit)
    with pytest.raises(Crash):
        durable.write_folder(dest, lambda d: (d / "a.txt").write_text("new"))
    assert not dest.exists()  # between the two renames: absent (old aside), never half old, half new
    kept = [p for p in durable.leftovers(tmp_path) if (p / "a.txt").is_file() and (p / "a.txt").read_text() == "old"]
    assert kept
    monkeypatch.undo()
    durable.write_folder(dest, lambda d: (d / "b.txt").write_text("new"))
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"]  # no mix of old and new files


def test_a_torn_journal_row_is_cut_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    durable.append_line(path, '{"round": 0}')
    with path.open("ab") as fh:
        fh.write(b'{"round": 1, "cli')  # what a crash mid-append leaves
    durable.append_line(path, '{"round": 1}')
    assert path.read_text() == '{"round": 0}\n{"round": 1}\n'


def test_a_manifest_catches_a_flipped_byte_of_the_same_size(tmp_path: Path) -> None:
    f = tmp_path / "server.safetensors"
    f.write_bytes(b"abcdef")
    manifest = durable.write_manifest(tmp_path / "MANIFEST", tmp_path, [f])
    assert durable.manifest_problem(tmp_path, manifest) is None
    f.write_bytes(b"abcdeF")
    assert "does not read back" in (durable.manifest_problem(tmp_path, manifest) or "")
    assert durable.manifest_problem(tmp_path, manifest, deep=False) is None  # sizes alone cannot tell
    f.write_bytes(b"abc")
    assert "has 3 bytes" in (durable.manifest_problem(tmp_path, manifest, deep=False) or "")


# --- a real run: FedDPA-T (a server adapter, private local adapters, journals) on the tiny model ---

FAMILIES = ["sorting", "capitals"]
DATA_OPTIONS = {"n_train": 3, "n_test": 1, "families": FAMILIES}
DATA = generate_suite(**DATA_OPTIONS)  # type: ignore[arg-type]
SIM = SimConfig(RoundConfig(rounds=2), embed=False)


def _train(out: Path, resume: bool = False) -> RunDir:
    run_federated("feddpa-t", DATA, tiny_llama(), out, SIM, preset("tiny"), resume=resume, data_spec="generated",
                  data_options=DATA_OPTIONS)
    return RunDir(out)


def _result(run: RunDir) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Every final adapter tensor, and the metrics rows without their timings."""
    tensors = {}
    for folder in [run.global_adapter] + [run.local_adapter(c) for c in FAMILIES]:
        for k, v in load_file(str(folder / "adapter_model.safetensors")).items():
            tensors[f"{folder.name}/{k}"] = v
    rows = [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in run.metrics.read_text().splitlines()]
    return tensors, rows


def _same(a: tuple[dict[str, torch.Tensor], list[dict[str, Any]]], b: tuple[dict, list]) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[dict, list], int]:
    """The uninterrupted run's result, and how many durable write points it has."""
    counter = Injector()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(durable, "_commit", counter.commit)
        mp.setattr(durable, "_append", counter.append)
        run = _train(tmp_path_factory.mktemp("straight") / "run")
    return _result(run), counter.count


def test_a_crash_at_every_write_point_resumes_to_the_uninterrupted_run(straight: tuple[tuple[dict, list], int],
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reference, points = straight
    assert points >= 20  # run.json, 2 x (rows, server, global/, strategy, transport, clients, COMPLETE), exports
    for at in range(1, points + 1):
        out = tmp_path / f"crash-{at}"
        injector = Injector(at)
        monkeypatch.setattr(durable, "_commit", injector.commit)
        monkeypatch.setattr(durable, "_append", injector.append)
        with pytest.raises(Crash):
            _train(out)
        monkeypatch.undo()
        resumed = _train(out, resume=True)
        assert _same(_result(resumed), reference), f"crash at write point {at} of {points}"
        # every folder of the run: an export's temporary lies beside its destination (adapters/, a client's)
        assert not sorted(out.rglob(f"{durable.TMP_PREFIX}*")), f"crash at write point {at} of {points}"


@pytest.mark.parametrize("damage", ["server.safetensors", "global/adapter_model.safetensors", "strategy.json",
                                    "transport.json", "clients/capitals/local.safetensors", COMPLETE])
def test_a_torn_file_in_the_newest_round_falls_back_to_the_round_before(straight: tuple[tuple[dict, list], int],
                                                                        tmp_path: Path, damage: str) -> None:
    run = _train(tmp_path / "run")
    target = run.round_dir(1) / damage
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])  # a power loss without fsync: renamed, but half the bytes
    assert last_complete(run) == 0
    if damage == "server.safetensors":  # one of them all the way through: round 1 is computed again
        assert _same(_result(_train(run.root, resume=True)), straight[0])
