"""A resumable prediction cache: one JSONL per (checkpoint, model key, task), appended batch by batch.

An evaluation that is interrupted (Ctrl-C, a crash, a killed machine) keeps every completed batch; the
next run reads the finished rows, skips them, and generates only the rest. A torn last line is
ignored and its row recomputed. A row whose prompt no longer matches is recomputed too, so a changed
data set or template never mixes stale predictions into the scores.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path


class PredictionCache:
    """Cached generations under ``root/<checkpoint>/<key>/<task>.jsonl``."""

    def __init__(self, root: Path, limit: int | None = None) -> None:
        self.root = root
        self.limit = limit

    def path(self, checkpoint: str, key: str, task: str) -> Path:
        """File of one (checkpoint, model key, task)."""
        return self.root / checkpoint / key / f"{task}.jsonl"

    def read(self, checkpoint: str, key: str, task: str) -> dict[int, dict]:
        """Finished rows by example index (torn or malformed lines are skipped)."""
        path = self.path(checkpoint, key, task)
        rows: dict[int, dict] = {}
        if not path.is_file():
            return rows
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                rows[int(row["i"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return rows

    def fill(
        self,
        checkpoint: str,
        key: str,
        task: str,
        prompts: Sequence[str],
        references: Sequence[str],
        generate: Callable[[Sequence[str]], list[str]],
        batch_size: int = 8,
    ) -> list[str]:
        """Return predictions for every prompt, generating (and appending) only the missing ones."""
        done = self.read(checkpoint, key, task)
        todo = [i for i, p in enumerate(prompts) if i not in done or done[i].get("prompt") != p]
        path = self.path(checkpoint, key, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        if todo and path.is_file() and not path.read_bytes().endswith(b"\n"):
            with path.open("a", encoding="utf-8") as fh:
                fh.write("\n")  # close a torn line so the next row starts clean
        for start in range(0, len(todo), batch_size):
            idx = todo[start:start + batch_size]
            outs = generate([prompts[i] for i in idx])
            if len(outs) != len(idx):
                raise RuntimeError(f"generation returned {len(outs)} answers for {len(idx)} prompts")
            with path.open("a", encoding="utf-8") as fh:
                for i, out in zip(idx, outs, strict=True):
                    row = {"i": i, "prompt": prompts[i], "prediction": out, "reference": references[i]}
                    fh.write(json.dumps(row) + "\n")
                    done[i] = row
                fh.flush()
        return [done[i]["prediction"] for i in range(len(prompts))]
