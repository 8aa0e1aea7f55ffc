"""Tables in the layout of paper 000 Table 1: Personalization and Test-Time Personalization blocks.

Input: per model key (each client id, ``global``, ``base``) the scores on every task. Personalization
takes each client's score on its own task; test-time personalization (TTP) each client's mean over all
tasks (paper 000 section 5.1). One row per method run; the global model and the bare base model are
rows too (scored on the same tasks). Columns are the clients' tasks, then the average.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedmosaic.evaluation.metrics import Scores

ScoreGrid = Mapping[str, Mapping[str, Scores]]  # model key -> task -> scores


@dataclass(frozen=True)
class Row:
    """One table row: a label, the per-client values (column order), and their mean."""

    label: str
    values: tuple[float, ...]

    @property
    def avg(self) -> float:
        """Mean over the columns."""
        return sum(self.values) / len(self.values) if self.values else 0.0


def block_rows(
    label: str, grid: ScoreGrid, clients: Sequence[str], client_tasks: Mapping[str, str], metric: str,
    extra: Sequence[str] = ("global", "base"),
) -> dict[str, list[Row]]:
    """Rows of both blocks for one run: the personalized clients, then the ``extra`` model keys.

    A client column shows the personalized model's score on that client's task (personalization) and
    its mean over all tasks (TTP); for ``global``/``base`` the same model fills every column.
    """
    tasks = sorted({t for k in grid.values() for t in k})

    def own(key: str, client: str) -> float:
        return grid[key][client_tasks[client]].get(metric)

    def ttp(key: str) -> float:
        return sum(grid[key][t].get(metric) for t in tasks) / len(tasks)

    pers = [Row(label, tuple(own(c, c) for c in clients))]
    test_time = [Row(label, tuple(ttp(c) for c in clients))]
    for key in extra:
        if key in grid:
            pers.append(Row(f"{label} [{key}]", tuple(own(key, c) for c in clients)))
            test_time.append(Row(f"{label} [{key}]", tuple(ttp(key) for _ in clients)))
    return {"personalization": pers, "ttp": test_time}


def markdown(blocks: Mapping[str, Sequence[Row]], columns: Sequence[str], metric: str) -> str:
    """Render both blocks as one Markdown table with block separator rows, values to 2 decimals."""
    title = {"personalization": "Personalization", "ttp": "Test-Time Personalization"}
    head = "| Method | " + " | ".join(columns) + " | Avg |"
    rule = "|---|" + "---:|" * (len(columns) + 1)
    lines = [f"Metric: {metric} (x100)", "", head, rule]
    for name, rows in blocks.items():
        lines.append(f"| **{title.get(name, name)}** |" + " |" * (len(columns) + 1))
        for row in rows:
            lines.append(f"| {row.label} | " + " | ".join(f"{v:.2f}" for v in row.values) + f" | {row.avg:.2f} |")
    return "\n".join(lines) + "\n"


def blocks_json(blocks: Mapping[str, Sequence[Row]], columns: Sequence[str]) -> dict[str, list[dict[str, object]]]:
    """The same blocks as JSON-ready dicts (``{label, values: {column: v}, avg}``)."""
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
