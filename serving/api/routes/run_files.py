"""GET /v1/run/files[/{path}]: the served run's evaluation outputs (tables, plots), read-only.

``fedmosaic eval RUN_DIR`` writes ``eval/table.md``, ``eval/results.json`` and PNG plots (paper 000
Table 1 layout, ``fedmosaic.evaluation``). The demo is a client of this API only, so it fetches them
here instead of reading the run directory. Only files under ``<run_dir>/eval`` with an allowed suffix
are listed or served; a path that resolves elsewhere (``..``, a symlink out) is refused with 403, and
the prediction cache is never exposed. Admin keys only (any valid key when no admin key is configured).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse

from serving.api.dependencies import get_settings, require_admin
from serving.api.openapi import errors
from serving.errors import PathNotAllowed
from serving.pool.paths import path_problem, shown_path

router = APIRouter(dependencies=[Depends(require_admin)])

EVAL_DIR = "eval"
MEDIA_TYPES = {".md": "text/markdown; charset=utf-8", ".png": "image/png", ".json": "application/json"}
HIDDEN = ("predictions",)  # the per-model prediction cache: large, and not a report


def _eval_root(request: Request) -> tuple[Path, Path]:
    """(resolved run dir, resolved eval dir); 404 when no run is served or it has no evaluation yet."""
    run_dir = get_settings(request).run_dir
    if run_dir is None:
        raise HTTPException(404, "this server serves no run directory (start it as `fedmosaic serve RUN_DIR`)")
    run = Path(run_dir).resolve()
    root = (run / EVAL_DIR).resolve()
    if not root.is_dir():
        raise HTTPException(404, "the run has no evaluation yet; run `fedmosaic eval RUN_DIR`")
    return run, root


def _listed(path: Path, root: Path) -> bool:
    rel = path.relative_to(root)
    return path.is_file() and path.suffix in MEDIA_TYPES and not (rel.parts and rel.parts[0] in HIDDEN)


@router.get("/v1/run/files", responses=errors(401, 403, 404))
def list_run_files(request: Request) -> dict[str, Any]:
    """List the evaluation files: ``{"object": "list", "data": [{"path", "bytes", "media_type"}]}``.

    Paths are relative to the run directory (``eval/table.md``) and are what the GET below accepts.
    """
    run, root = _eval_root(request)
    files = []
    for path in sorted(root.rglob("*")):
        # resolve() so a symlink pointing out of eval/ is neither listed nor followed
        if _listed(path, root) and path.resolve().is_relative_to(root):
            files.append({"path": path.relative_to(run).as_posix(), "bytes": path.stat().st_size,
                          "media_type": MEDIA_TYPES[path.suffix]})
    return {"object": "list", "run": run.name, "data": files}


@router.get("/v1/run/files/{path:path}", response_model=None,
            responses={200: {"description": "the file", "content": {
                media.split(";")[0]: {"schema": {"type": "string", "format": "binary"}}
                for media in MEDIA_TYPES.values()}}, **errors(400, 401, 403, 404)})
def get_run_file(path: str, request: Request) -> FileResponse:
    """Return one evaluation file.

    Raises:
        PathNotAllowed: the path resolves outside ``<run_dir>/eval`` (403).
        HTTPException: 404 for a missing or unlisted file, 400 for a suffix that is never served.
    """
    run, root = _eval_root(request)
    shown = shown_path(path)
    try:
        target = (run / path).resolve()
    except (RuntimeError, OSError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise HTTPException(400, f"{shown} {path_problem(exc)}") from exc
    if not target.is_relative_to(root):
        raise PathNotAllowed(f"{shown} is outside the run's {EVAL_DIR}/ folder")
    if target.suffix not in MEDIA_TYPES:
        raise HTTPException(400, f"only {sorted(MEDIA_TYPES)} files are served, not {shown}")
    try:
        listed = _listed(target, root)
    except OSError as exc:  # a name longer than the file system allows
        raise HTTPException(400, f"{shown} {path_problem(exc)}") from exc
    if not listed:
        raise HTTPException(404, f"no evaluation file {shown}; list them with GET /v1/run/files")
    return FileResponse(target, media_type=MEDIA_TYPES[target.suffix])
