"""Tables in the layout of paper 000 Table 1: Personalization and Test-Time Personalization blocks.

Input: per model key (each client id, ``global``, ``base``) the scores on every task. Personalization
takes each client's score on its own task; test-time personalization (TTP) each client's mean over all
tasks (paper 000 section 5.1). One row per method run; the global model and the bare base model are
rows too (scored on the same tasks). Columns are the clients' tasks, then the average.

On a test set the clients never saw (``fedmosaic eval --test``, paper 000 Table 14) a client's own task
may be absent: its Personalization cell is ``n/a`` and the block's average covers the other clients;
when no client's task is present the block is left out. TTP always covers the given tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from training.scoring import Scores

ScoreGrid = Mapping[str, Mapping[str, Scores]]  # model key -> task -> scores


@dataclass(frozen=True)
class Row:
    """One table row: a label, the per-client values (column order; None: no score), and their mean."""

    label: str
    values: tuple[float | None, ...]

    @property
    def avg(self) -> float | None:
        """Mean over the columns that have a value (None when none has)."""
        present = [v for v in self.values if v is not None]
        return sum(present) / len(present) if present else None


def block_rows(
    label: str, grid: ScoreGrid, clients: Sequence[str], client_tasks: Mapping[str, str], metric: str,
    extra: Sequence[str] = ("global", "base"), ttp_grid: ScoreGrid | None = None,
) -> dict[str, list[Row]]:
    """Rows of both blocks for one run: the personalized clients, then the ``extra`` model keys.

    A client column shows the personalized model's score on that client's task (personalization) and
    its mean over all tasks (TTP); for ``global``/``base`` the same model fills every column. A client
    whose task is not among the scored tasks has no personalization value; with none present, the
    Personalization block is left out. ``ttp_grid`` (scores on fewer examples per task, the same for
    every model) gives the TTP block instead of ``grid``.
    """
    tasks = sorted({t for k in grid.values() for t in k})

    def own(key: str, client: str) -> float | None:
        scores = grid[key].get(client_tasks[client])
        return scores.get(metric) if scores is not None else None

    def ttp(key: str) -> float:
        source = grid if ttp_grid is None else ttp_grid
        return sum(source[key][t].get(metric) for t in tasks) / len(tasks)

    pers = [Row(label, tuple(own(c, c) for c in clients))]
    test_time = [Row(label, tuple(ttp(c) for c in clients))]
    for key in extra:
        if key in grid:
            pers.append(Row(f"{label} [{key}]", tuple(own(key, c) for c in clients)))
            test_time.append(Row(f"{label} [{key}]", tuple(ttp(key) for _ in clients)))
    if not any(client_tasks[c] in tasks for c in clients):
        return {"ttp": test_time}
    return {"personalization": pers, "ttp": test_time}


def coverage_notes(clients: Sequence[str], client_tasks: Mapping[str, str], tasks: Sequence[str]) -> list[str]:
    """Lines under the table saying which clients' own tasks the test set lacks (none when it has them all)."""
    absent = [c for c in clients if client_tasks[c] not in tasks]
    if not absent:
        return []
    ttp = f"Test-Time Personalization is each model's mean over the test set's {len(tasks)} tasks."
    if len(absent) == len(clients):
        return [f"Personalization omitted: no client's own task is in the test set. {ttp}"]
    named = ", ".join(f"{c} ({client_tasks[c]})" for c in absent)
    return [f"Personalization n/a: the own task of {named} is not in the test set; the block's Avg covers "
            f"the other clients. {ttp}"]


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def markdown(blocks: Mapping[str, Sequence[Row]], columns: Sequence[str], metric: str, title: str = "",
             notes: Sequence[str] = ()) -> str:
    """Render the blocks as one Markdown table with block separator rows, values to 2 decimals.

    Args:
        blocks: block name -> rows (:func:`block_rows`).
        columns: the column headers (each client's own task).
        metric: the metric named above the table.
        title: the first line (which test set was scored); none when empty.
        notes: lines under the table (:func:`coverage_notes`).
    """
    names = {"personalization": "Personalization", "ttp": "Test-Time Personalization"}
    head = "| Method | " + " | ".join(columns) + " | Avg |"
    rule = "|---|" + "---:|" * (len(columns) + 1)
    lines = [title, ""] if title else []
    lines += [f"Metric: {metric} (x100)", "", head, rule]
    for name, rows in blocks.items():
        lines.append(f"| **{names.get(name, name)}** |" + " |" * (len(columns) + 1))
        for row in rows:
            lines.append(f"| {row.label} | " + " | ".join(map(_cell, row.values)) + f" | {_cell(row.avg)} |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def blocks_json(blocks: Mapping[str, Sequence[Row]], columns: Sequence[str]) -> dict[str, list[dict[str, object]]]:
    """The same blocks as JSON-ready dicts (``{label, values: {column: v}, avg}``; ``null`` where no score)."""
    return {
        name: [{"label": r.label, "values": dict(zip(columns, r.values, strict=True)), "avg": r.avg} for r in rows]
        for name, rows in blocks.items()
    }


def merge_blocks(per_run: Sequence[Mapping[str, Sequence[Row]]]) -> dict[str, list[Row]]:
    """Stack several runs' blocks (comparison mode: one row group per run)."""
    merged: dict[str, list[Row]] = {}
    for blocks in per_run:
        for name, rows in blocks.items():
            merged.setdefault(name, []).extend(rows)
    return merged
