"""Durable files: what a run writes survives a crash or a power loss whole, or not at all.

Every file goes to a temporary name beside its target, is fsync'ed, renamed into place, and its folder
fsync'ed (a rename is only durable once the directory entry is on disk), so a path holds either its old
or its new content, never a torn mix. A folder (a PEFT adapter, a node's private-state version) is
filled under a temporary name and renamed the same way. Journals (``metrics.jsonl``) are appended with
an fsync per row; a row torn by a crash is cut off before the next append, so completed rows are never
lost and the journal never ends mid-line.

A manifest (:func:`write_manifest`) names the files of a folder with their size and SHA-256 as read back
from disk after the writes; :func:`manifest_problem` checks them again, so a checkpoint counts only when
every file it names reads back as written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TMP_PREFIX = ".tmp-"


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (new, renamed or deleted names) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _commit(tmp: Path, path: Path) -> None:
    """Rename a fully written, fsync'ed temporary file into place (the one step a crash test interrupts)."""
    os.replace(tmp, path)


def write_file(path: Path, write: Callable[[Path], object]) -> None:
    """Run ``write(tmp)`` on a temporary file beside ``path``; fsync it, rename it to ``path``, fsync the folder.

    A failed ``write`` removes the temporary file and leaves ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        _fsync_file(tmp)
        _commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: Path, data: bytes) -> None:
    """Durably replace ``path`` with ``data``."""
    write_file(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: Path, text: str) -> None:
    """Durably replace ``path`` with ``text``."""
    write_bytes(path, text.encode())


def write_json(path: Path, data: Any) -> None:
    """Durably replace ``path`` with ``data`` as indented JSON."""
    write_text(path, json.dumps(data, indent=2))


def save_tensors(path: Path, state: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Durably write ``state`` as a safetensors file (CPU, contiguous copies)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def write_folder(dest: Path, fill: Callable[[Path], object]) -> None:
    """Build a folder with ``fill(tmp_folder)``, fsync every file in it, then put it at ``dest``.

    An existing ``dest`` is moved aside first and deleted after the swap: between the two renames a
    crash leaves no ``dest``, never a mix of old and new files (readers treat a missing folder as absent).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=dest.parent))
    try:
        fill(tmp)
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                _fsync_file(p)
        for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, reverse=True):
            fsync_dir(d)
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=dest.parent))
            os.rmdir(old)
            os.replace(dest, old)
        _commit(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _append(fh: Any, data: bytes) -> None:
    """Write one journal row (the other step a crash test interrupts)."""
    fh.write(data)


def append_line(path: Path, line: str) -> None:
    """Append one line to the journal at ``path`` and fsync it.

    A last line without its newline is what a crash mid-append leaves: it is cut off first, so the
    journal holds only whole rows.
    """
    path = Path(path)
    created = not path.exists()
    with open(path, "ab+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":
                fh.seek(0)
                data = fh.read()
                fh.truncate(data.rfind(b"\n") + 1)
        fh.seek(0, os.SEEK_END)
        _append(fh, (line.rstrip("\n") + "\n").encode())
        fh.flush()
        os.fsync(fh.fileno())
    if created:
        fsync_dir(path.parent)


def digest(path: Path) -> str:
    """SHA-256 of a file's bytes as read from disk."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(path: Path, folder: Path, files: Iterable[Path]) -> dict[str, Any]:
    """Read back ``files`` (inside ``folder``) and durably write their sizes and SHA-256 to ``path``.

    Returns:
        The manifest: ``{"files": {relative path: {"size": bytes, "sha256": hex}}}``.
    """
    entries = {}
    for f in sorted(Path(f) for f in files):
        entries[f.relative_to(folder).as_posix()] = {"size": f.stat().st_size, "sha256": digest(f)}
    manifest = {"files": entries}
    write_json(path, manifest)
    return manifest


def manifest_problem(folder: Path, manifest: Mapping[str, Any], deep: bool = True,
                     skip: Callable[[str], bool] = lambda name: False) -> str | None:
    """Why the files a manifest names do not read back as written, or None when they all do.

    Args:
        folder: the folder the manifest's paths are relative to.
        manifest: what :func:`write_manifest` wrote.
        deep: compare SHA-256 (reads every byte); False checks presence and sizes only.
        skip: names not to check (a file deleted on purpose since).
    """
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "its manifest lists no files"
    for name, entry in files.items():
        if skip(name):
            continue
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != entry.get("size"):
            return f"{name} has {p.stat().st_size} bytes, the manifest says {entry.get('size')}"
        if deep and digest(p) != entry.get("sha256"):
            return f"{name} does not read back as written (SHA-256 differs)"
    return None


def leftovers(folder: Path) -> list[Path]:
    """Temporary files and folders an interrupted write left in ``folder`` (safe to delete)."""
    return sorted(folder.glob(f"{TMP_PREFIX}*")) if folder.is_dir() else []
