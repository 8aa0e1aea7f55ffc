"""The names and folders a client may hand the server: checked before anything is read.

An adapter load over HTTP (``POST /v1/load_lora_adapter``, vLLM's runtime-LoRA route) names a folder
and the name to serve it under; ``GET /v1/run/files/{path}`` names an evaluation file. Both come from
the network, so a path is resolved (symlinks included) and must stay inside the folder the server
allows, and one the operating system cannot take (``~`` of an unknown user, a symlink loop, a NUL
byte, a name longer than the file system allows) is refused with a message naming it, never a 500.
Messages quote at most 120 characters of a path, since a hostile one may be megabytes long.
"""

from __future__ import annotations

import re
from pathlib import Path

from serving.errors import AdapterLoadFailed, PathNotAllowed

__all__ = ["check_adapter_name", "check_folder_files", "path_problem", "resolve_adapter_path", "shown_path"]

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}$")


def shown_path(path: object, limit: int = 120) -> str:
    """``path`` quoted for an error message, cut to ``limit`` characters."""
    text = str(path)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def path_problem(exc: RuntimeError | OSError | ValueError) -> str:
    """What is wrong with a path pathlib or the OS refused, worded to follow the path in a message.

    Args:
        exc: what ``Path.expanduser``, ``Path.resolve`` or a ``stat`` raised (a symlink loop, a NUL
            byte, a name longer than the file system allows).
    """
    if isinstance(exc, RuntimeError):
        return f"cannot be resolved: {exc}"
    return f"is not a usable path: {(exc.strerror or str(exc)) if isinstance(exc, OSError) else exc}"


def check_adapter_name(name: str) -> None:
    """Refuse a name that is not a plain adapter name.

    Raises:
        AdapterLoadFailed: ``name`` has characters other than letters, digits, ``_ - . :``, starts
            with one of ``- . :``, ends with ``:`` or is longer than 128 characters.
    """
    if not _NAME.match(name) or name.endswith(":"):
        raise AdapterLoadFailed(f"invalid adapter name {shown_path(name)}: use letters, digits, '_', '-', '.', ':'")


def resolve_adapter_path(path: str | Path, root: Path | None) -> Path:
    """Resolve an adapter folder (relative ones against ``root``) and check it stays inside ``root``.

    Args:
        path: the folder as the client gave it.
        root: the resolved adapter root; None allows any folder (trusted command-line use only).

    Raises:
        PathNotAllowed: it resolves outside the root (``..``, absolute paths, symlinks).
        AdapterLoadFailed: it is no usable path (``~user`` of an unknown user, a symlink loop, a NUL
            byte, a name longer than the file system allows).
    """
    shown = shown_path(path)
    try:
        raw = Path(path).expanduser()
    except RuntimeError as exc:
        raise AdapterLoadFailed(f"adapter path {shown} starts with '~' but names no home folder here") from exc
    try:
        if not raw.is_absolute() and root is not None:
            raw = root / raw
        resolved = raw.resolve()
    except (RuntimeError, OSError, ValueError) as exc:
        raise AdapterLoadFailed(f"adapter path {shown} {path_problem(exc)}") from exc
    if root is not None and not resolved.is_relative_to(root):
        raise PathNotAllowed(f"adapter path {shown} resolves outside the adapter root {root}")
    try:
        resolved.exists()  # the checks after this one stat the folder: a name too long fails here, once
    except OSError as exc:
        raise AdapterLoadFailed(f"adapter path {shown} {path_problem(exc)}") from exc
    return resolved


def check_folder_files(folder: Path, root: Path | None) -> None:
    """Check that every file of an adapter folder resolves inside ``root``, as the folder does.

    The folder's own path is checked by :func:`resolve_adapter_path`; a file in it may still be a
    symlink to anywhere on disk, and is read when the adapter loads (or reloads after an eviction).

    Raises:
        PathNotAllowed: a file or subfolder of ``folder`` resolves outside the root.
        AdapterLoadFailed: the folder cannot be listed or an entry cannot be resolved.
    """
    if root is None or not folder.is_dir():  # a missing folder: the loader says so
        return
    try:
        for child in folder.iterdir():
            if not child.resolve().is_relative_to(root):
                raise PathNotAllowed(f"{shown_path(child.name)} in adapter folder {shown_path(folder.name)} "
                                     f"resolves outside the adapter root {root}")
    except (RuntimeError, OSError, ValueError) as exc:
        raise AdapterLoadFailed(f"adapter folder {shown_path(folder.name)} {path_problem(exc)}") from exc
