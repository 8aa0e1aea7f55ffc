"""A resumable prediction cache: one JSONL per (checkpoint, model key, task), appended row by row.

An evaluation that is interrupted (Ctrl-C, a crash, a killed machine) keeps every finished row; the
next run reads the finished rows, skips them, and generates only the rest. A torn last line is
ignored and its row recomputed. A row whose prompt no longer matches is recomputed too. A row whose
``tag`` (how it was generated: served target, routing, decoding, ``num_beams``, ``max_new_tokens``)
differs from the one asked for is never used, so a changed data set, template, target or decoding
setting never mixes stale predictions into the scores; rows of several settings are kept side by
side, so returning to a setting costs nothing. Rows may carry extra fields (e.g. the FedDPA weights
an answer was decoded with).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prediction:
    """A generated answer and extra fields stored with it (JSON-serialisable)."""

    text: str
    extra: Mapping[str, Any] = field(default_factory=dict)


class PredictionCache:
    """Cached generations under ``root/<checkpoint>/<key>/<task>.jsonl``."""

    def __init__(self, root: Path, limit: int | None = None) -> None:
        self.root = root
        self.limit = limit

    def path(self, checkpoint: str, key: str, task: str) -> Path:
        """File of one (checkpoint, model key, task)."""
        return self.root / checkpoint / key / f"{task}.jsonl"

    def read(self, checkpoint: str, key: str, task: str, tag: str | None = None) -> dict[int, dict]:
        """Finished rows by example index (torn or malformed lines are skipped; the last row of an index wins).

        With ``tag``, only rows generated that way count: answers of several settings (greedy and 4 beams,
        64 and 80 tokens) live side by side in one file, and going back to a setting reuses its rows.
        """
        path = self.path(checkpoint, key, task)
        rows: dict[int, dict] = {}
        if not path.is_file():
            return rows
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                if tag is None or row.get("tag") == tag:
                    rows[int(row["i"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue
        return rows

    def missing(self, checkpoint: str, key: str, task: str, prompts: Sequence[str], tag: str | None = None
                ) -> list[int]:
        """Indexes of ``prompts`` without a valid row (absent, other prompt, or another ``tag``)."""
        done = self.read(checkpoint, key, task, tag)
        return [i for i, p in enumerate(prompts) if not _valid(done.get(i), p, tag)]

    def append(self, checkpoint: str, key: str, task: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append finished rows (each with ``i``, ``prompt``, ``prediction``) and flush them to disk."""
        path = self.path(checkpoint, key, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        with path.open("a", encoding="utf-8") as fh:
            if torn:
                fh.write("\n")  # close a torn line so the next row starts clean
            for row in rows:
                fh.write(json.dumps(dict(row)) + "\n")
            fh.flush()

    def rows(self, checkpoint: str, key: str, task: str, prompts: Sequence[str], tag: str | None = None
             ) -> list[dict]:
        """The valid row of every prompt, in order.

        Raises:
            KeyError: a prompt has no valid row yet.
        """
        done = self.read(checkpoint, key, task, tag)
        bad = [i for i, p in enumerate(prompts) if not _valid(done.get(i), p, tag)]
        if bad:
            raise KeyError(f"{self.path(checkpoint, key, task)} lacks valid rows for examples {bad[:10]}")
        return [done[i] for i in range(len(prompts))]

    def fill(
        self,
        checkpoint: str,
        key: str,
        task: str,
        prompts: Sequence[str],
        references: Sequence[str],
        generate: Callable[[Sequence[str]], Sequence[str | Prediction]],
        batch_size: int = 8,
        tag: str | None = None,
    ) -> list[str]:
        """Return predictions for every prompt, generating (and appending) only the missing ones.

        ``generate`` returns plain strings or :class:`Prediction` objects (whose extras are stored).
        """
        todo = self.missing(checkpoint, key, task, prompts, tag)
        for start in range(0, len(todo), batch_size):
            idx = todo[start:start + batch_size]
            outs = generate([prompts[i] for i in idx])
            if len(outs) != len(idx):
                raise RuntimeError(f"generation returned {len(outs)} answers for {len(idx)} prompts")
            self.append(checkpoint, key, task, [make_row(i, prompts[i], references[i], out, tag)
                                                for i, out in zip(idx, outs, strict=True)])
        return [row["prediction"] for row in self.rows(checkpoint, key, task, prompts, tag)]


def make_row(i: int, prompt: str, reference: str, out: str | Prediction, tag: str | None = None) -> dict[str, Any]:
    """The cache row of example ``i``."""
    pred = out if isinstance(out, Prediction) else Prediction(out)
    row: dict[str, Any] = {"i": i, "prompt": prompt, "prediction": pred.text, "reference": reference}
    if tag is not None:
        row["tag"] = tag
    row.update({k: v for k, v in pred.extra.items() if k not in row})
    return row


def _valid(row: Mapping[str, Any] | None, prompt: str, tag: str | None) -> bool:
    return row is not None and row.get("prompt") == prompt and (tag is None or row.get("tag") == tag)
