"""The run directory's two journals: ``run.json`` (the run's settings) and ``metrics.jsonl`` (one row per
client per round, then one per round), plus ``summary.json``.

Rows are appended as the round loop (:mod:`training.rounds`) produces them; a resumed run first drops
the rows of rounds it will run again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path``."""
    path.write_text(json.dumps(data, indent=2))


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON row to the journal at ``path``."""
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def trim_rows(path: Path, start: int) -> None:
    """Drop the rows of rounds >= ``start`` (left by an interrupted attempt) before resuming."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("round", -1) < start:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    path.write_text("".join(x + "\n" for x in keep))
