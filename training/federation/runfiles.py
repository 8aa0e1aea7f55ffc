"""The run directory's two journals: ``run.json`` (the run's settings) and ``metrics.jsonl`` (one row per
client per round, then one per round, then a ``finalize`` row per client whose personalization trains),
plus ``summary.json``.

Rows are appended as the round loop (:mod:`training.federation.rounds`) produces them, each fsync'ed
(:func:`training.federation.durable.append_line`); a resumed run first drops the rows of rounds it will run again
by writing the kept rows to a new file that replaces the journal whole, so a crash at any point leaves
either the old journal or the trimmed one. JSON files are replaced the same way, never rewritten in place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.federation import durable


def write_json(path: Path, data: Any) -> None:
    """Durably write ``data`` as indented JSON to ``path`` (left untouched when it already holds exactly that)."""
    text = json.dumps(data, indent=2)
    try:
        if path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    durable.write_text(path, text)


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Durably append one JSON row to the journal at ``path``."""
    durable.append_line(path, json.dumps(row))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The journal's rows; a line that is not a JSON object (torn by a crash) is skipped."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def trim_rows(path: Path, start: int) -> None:
    """Drop the rows of rounds >= ``start`` (left by an interrupted attempt) and torn lines before resuming."""
    if not path.is_file():
        return
    keep = [row for row in read_rows(path) if row.get("round", -1) < start]
    text = "".join(json.dumps(row) + "\n" for row in keep)
    if path.read_text() != text:
        durable.write_text(path, text)
