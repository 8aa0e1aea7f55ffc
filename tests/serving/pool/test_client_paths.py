"""serving.pool.paths: every path or name a client may send is resolved inside its root or refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.errors import AdapterLoadFailed, PathNotAllowed
from serving.pool.paths import check_adapter_name, path_problem, resolve_adapter_path, shown_path


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path / "outside")
    return (tmp_path / "root").resolve()


def test_relative_and_absolute_paths_inside_the_root_resolve(root: Path) -> None:
    assert resolve_adapter_path("a", root) == root / "a"
    assert resolve_adapter_path(root / "a" / ".." / "a", root) == root / "a"
    assert resolve_adapter_path("not-there-yet", root) == root / "not-there-yet"  # existence is the loader's job


@pytest.mark.parametrize("path", ["..", "../outside", "out", "/etc", "a/../../outside"])
def test_paths_leaving_the_root_are_refused_and_named(root: Path, path: str) -> None:
    with pytest.raises(PathNotAllowed, match="resolves outside the adapter root"):
        resolve_adapter_path(path, root)


def test_no_root_allows_any_folder(root: Path) -> None:
    assert resolve_adapter_path(root.parent / "outside", None) == root.parent / "outside"


@pytest.mark.parametrize(("path", "problem"), [
    ("~no-such-user-fedmosaic/a", "names no home folder"),
    ("a\x00b", "is not a usable path"),
    ("x" * 300, "is not a usable path: File name too long"),
])
def test_paths_the_os_cannot_take_are_refused_not_raised_raw(root: Path, path: str, problem: str) -> None:
    with pytest.raises(AdapterLoadFailed, match=problem) as info:
        resolve_adapter_path(path, root)
    assert len(str(info.value)) < 300  # the path is quoted cut short, not whole


def test_a_symlink_loop_is_refused(root: Path) -> None:
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(AdapterLoadFailed, match="loop"):
        resolve_adapter_path("loop", root)


def test_shown_path_cuts_long_paths_and_path_problem_words_each_kind() -> None:
    assert shown_path("abc") == "'abc'"
    assert shown_path("y" * 500) == repr("y" * 120 + "...")
    assert path_problem(RuntimeError("Symlink loop from '/x'")) == "cannot be resolved: Symlink loop from '/x'"
    assert path_problem(OSError(36, "File name too long")) == "is not a usable path: File name too long"
    assert path_problem(ValueError("embedded null byte")) == "is not a usable path: embedded null byte"


@pytest.mark.parametrize("name", ["global", "c7:local", "hot-1.v2", "_x", "a" * 128])
def test_plain_adapter_names_pass(name: str) -> None:
    check_adapter_name(name)


@pytest.mark.parametrize("name", ["", "-x", ".x", ":x", "a:", "a/b", "a b", "é", "a" * 129, "a\x00"])
def test_other_adapter_names_are_refused(name: str) -> None:
    with pytest.raises(AdapterLoadFailed, match="invalid adapter name"):
        check_adapter_name(name)
