"""``fedmosaic data fetch``: a file:// round trip, checksum and offline errors; defaults keyed on content."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from fedmosaic.cli import main
from training.data import BENCHMARKS, data_key, identify, load_dataset
from training.data.benchmarks import Benchmark, sha256

SHARED = Path("/work/shared/data")  # the pinned commits' files (FEDMOSAIC_DATA_DIR in this workspace)


def fake_feddpa2(root: Path) -> Path:
    """A small FedDPA dataset 2 stand-in: two clients and a test file in the benchmark layout."""
    (root / "8").mkdir(parents=True)
    for i, task in enumerate(("hellaswag", "qnli")):
        rows = [{"instruction": f"{task} q{j}", "output": f"a{j}", "task": task} for j in range(4)]
        (root / "8" / f"local_training_{i}.json").write_text(json.dumps(rows))
    (root / "flan_test.jsonl").write_text("".join(json.dumps({"instruction": f"t{t}", "output": "x", "task": t}) + "\n"
                                                  for t in ("hellaswag", "qnli")))
    return root


def tarball(files: Path, out: Path, inside: str, corrupt: str | None = None) -> str:
    """GitHub's layout, ``<repo>-<commit>/<inside>/...``, as a file:// URL; ``corrupt`` alters that file."""
    with tarfile.open(out, "w:gz") as tar:
        readme = b"the rest of the repository"
        info = tarfile.TarInfo("repo-abc/README.md")
        info.size = len(readme)
        tar.addfile(info, io.BytesIO(readme))
        for path in sorted(p for p in files.rglob("*") if p.is_file()):
            rel = path.relative_to(files).as_posix()
            data = path.read_bytes() + (b" " if rel == corrupt else b"")
            info = tarfile.TarInfo(f"repo-abc/{inside}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.as_uri()


@pytest.fixture
def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Benchmark:
    """feddpa2 pinned to the stand-in's sums; an empty data cache; no FEDMOSAIC_DATA_DIR."""
    files = fake_feddpa2(tmp_path / "upstream")
    sums = {p.relative_to(files).as_posix(): sha256(p) for p in files.rglob("*") if p.is_file()}
    bench = Benchmark("feddpa2", "feddpa/dataset2", "Lydia-yang/FedDPA", "0" * 40, "data/dataset2", "terms", sums)
    monkeypatch.setitem(BENCHMARKS, "feddpa2", bench)
    monkeypatch.delenv("FEDMOSAIC_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return bench


def print_config(data: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["train", "--method", "feddpa-t", "--data", data, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_fetch_round_trip_then_the_name_and_the_folder_give_the_same_config(
        tmp_path: Path, pinned: Benchmark, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="'feddpa2' is not in .*cache/fedmosaic/data/feddpa/dataset2"):
        main(["data", "show", "feddpa2"])
    url = tarball(tmp_path / "upstream", tmp_path / "FedDPA.tar.gz", "data/dataset2")
    assert main(["data", "fetch", "feddpa2", "--url", url]) == 0
    target = tmp_path / "cache" / "fedmosaic" / "data" / "feddpa" / "dataset2"
    assert f"3 files checked (SHA-256) in {target}" in capsys.readouterr().out
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["benchmark"] == "feddpa2" and manifest["sha256"] == pinned.sums and manifest["url"] == url
    assert {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()} == {*pinned.sums,
                                                                                           "manifest.json"}
    assert load_dataset("feddpa2").client_ids == ["0", "1"]  # no environment variable
    by_name = print_config("feddpa2", capsys)
    assert by_name["options"]["alpha"] == 0.3  # FedDPA-T's dataset 2 default (paper 000 s5.1)
    assert print_config(str(target), capsys) == by_name  # the folder by its manifest
    copy = shutil.copytree(target, tmp_path / "my copy", ignore=shutil.ignore_patterns("manifest.json"))
    assert identify(copy) == "feddpa2" and data_key(str(copy)) == "feddpa2"
    assert print_config(str(copy), capsys) == by_name  # by its content hash
    assert load_dataset(str(copy)).name == "feddpa2"
    (copy / "8" / "local_training_0.json").write_text("[]")  # other content: not the benchmark
    assert identify(copy) is None
    other = fake_feddpa2(tmp_path / "mine" / "dataset2")  # the same folder name, other files
    (other / "8" / "local_training_1.json").write_text(json.dumps([{"instruction": "q", "output": "o"}]))
    assert print_config(str(other), capsys)["options"]["alpha"] == 0.5
    assert main(["data", "fetch", "feddpa2", "--url", "file:///nowhere.tar.gz"]) == 0  # complete: nothing to do


def test_a_changed_file_fails_the_checksum_and_nothing_is_written(tmp_path: Path, pinned: Benchmark) -> None:
    url = tarball(tmp_path / "upstream", tmp_path / "bad.tar.gz", "data/dataset2", corrupt="8/local_training_1.json")
    with pytest.raises(SystemExit, match=r"bad.tar.gz: data/dataset2/8/local_training_1.json has SHA-256 [0-9a-f]{64}, "
                                         rf"expected {pinned.sums['8/local_training_1.json']} .*nothing was written"):
        main(["data", "fetch", "feddpa2", "--url", url])
    assert not (tmp_path / "cache" / "fedmosaic" / "data" / "feddpa").exists()
    short = tarball(tmp_path / "upstream", tmp_path / "other.tar.gz", "data/dataset1")  # the wrong folder
    with pytest.raises(SystemExit, match=r"lacks 3 of feddpa2's files under data/dataset2/"):
        main(["data", "fetch", "feddpa2", "--url", short])
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(SystemExit, match="junk.tar.gz is not a readable tarball"):
        main(["data", "fetch", "feddpa2", "--url", str(tmp_path / "junk.tar.gz")])


def test_offline_the_error_says_where_to_put_the_files_by_hand(tmp_path: Path, pinned: Benchmark) -> None:
    target = tmp_path / "cache" / "fedmosaic" / "data" / "feddpa" / "dataset2"
    for url in ("file:///no/such/FedDPA.tar.gz", "http://127.0.0.1:9/FedDPA.tar.gz"):  # never the network
        with pytest.raises(SystemExit) as err:
            main(["data", "fetch", "feddpa2", "--url", url])
        message = str(err.value)
        assert f"cannot download {url}" in message and "Offline? Fetch the files by hand" in message
        assert f"https://github.com/Lydia-yang/FedDPA/tree/{'0' * 40}/data/dataset2" in message
        assert f"copy the folder's files (8/local_training_0.json, 8/local_training_1.json ... (3 files)) into " \
               f"{target}/" in message and "--url PATH_TO_TARBALL" in message
    shutil.copytree(tmp_path / "upstream", target)  # by hand, as the message says
    assert load_dataset("feddpa2").name == "feddpa2" and identify(target) == "feddpa2"


@pytest.mark.skipif(not (SHARED / "feddpa" / "dataset2").is_dir(), reason="the benchmark data is not here")
def test_the_stored_sums_are_the_pinned_commits_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, bench in BENCHMARKS.items():
        assert identify(SHARED / bench.folder) == name
        assert bench.url == f"https://codeload.github.com/{bench.repo}/tar.gz/{bench.commit}"
    monkeypatch.delenv("FEDMOSAIC_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = tarball(SHARED / "feddpa" / "dataset2", tmp_path / "FedDPA.tar.gz", "data/dataset2")
    assert main(["data", "fetch", "feddpa2", "--url", url]) == 0
    capsys.readouterr()
    fetched = print_config("feddpa2", capsys)
    assert fetched == print_config(str(SHARED / "feddpa" / "dataset2"), capsys)  # no manifest: by content
    assert fetched["options"]["alpha"] == 0.3
