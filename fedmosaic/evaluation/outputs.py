"""What an evaluation writes besides its answers: ``table.md``, ``scores.png`` and the summary's blocks.

The Personalization and Test-Time Personalization tables (paper 000 section 5.2), FedOA's
out-of-distribution block (paper 001 Table 2) and each client's per-example scores, which let two runs
scored on the same test set be compared example by example. :mod:`.evaluate` computes the scores; this
module only lays them out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapters.rundir import RunDir
from fedmosaic.evaluation import plots, tables
from fedmosaic.evaluation.testsets import TestSet
from training.data import FederatedDataset
from training.scoring import Scores


def write_tables(run: RunDir, out: Path, cfg: dict, dataset: FederatedDataset, test_set: TestSet,
                 clients: list[str], grid: dict[str, dict[str, Scores]], metric: str, limit: int | None,
                 notes: list[str], ttp_grid: dict[str, dict[str, Scores]] | None = None) -> dict[str, Any]:
    """Write ``table.md`` and ``scores.png`` into ``out``; return the summary's scores, tables and Markdown.

    Args:
        grid: target -> task -> scores over the examples Personalization reads.
        limit: the examples per task the evaluation was cut to (None: all), for the coverage notes.
        notes: lines added under the table (e.g. what TTP reads).
        ttp_grid: the same for TTP where it reads fewer examples than ``grid``.
    """
    client_tasks = {c: dataset.task_of(c) for c in clients}
    label = str(cfg.get("method", run.root.name))
    blocks = tables.block_rows(label, grid, clients, client_tasks, metric, ttp_grid=ttp_grid)
    columns = [client_tasks[c] for c in clients]
    md = tables.markdown(blocks, columns, metric, title=test_set.heading(label),
                         notes=tables.coverage_notes(clients, client_tasks, test_set.tasks) + notes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(md)
    plots.plot_scores({k: {t: s.get(metric) for t, s in v.items()} for k, v in grid.items()},
                      out / "scores.png", metric)
    return {
        "run": str(run.root), "method": label,
        "test_set": {**test_set.summary(client_tasks, limit), "duplicates": dataset.duplicates},
        "clients": clients, "client_tasks": client_tasks, "tables": tables.blocks_json(blocks, columns),
        "markdown": md, "scores": {k: {t: s.asdict() for t, s in v.items()} for k, v in grid.items()},
        **({"ttp_scores": {k: {t: s.asdict() for t, s in v.items()} for k, v in ttp_grid.items()}} if ttp_grid else {}),
    }


def ood_block(out: Path, dataset: FederatedDataset, grid: dict[str, dict[str, Scores]], metric: str) -> dict:
    """FedOA's leave-one-task-out scores (paper 001 Table 2): every target's mean over the held-out tasks.

    Intra-client OOD is each client's personalised model (``<client>``) on the tasks nobody trained on;
    inter-client OOD is the global model's. Appended to ``out/table.md``.
    """
    held = list(dataset.held_out)
    means = {key: sum(float(by_task[t].get(metric)) for t in held) / len(held)
             for key, by_task in grid.items() if all(t in by_task for t in held)}
    lines = [f"\nOut of distribution ({metric}, mean over held-out tasks {', '.join(held)}):\n",
             "| target | " + " | ".join(held) + " | mean |", "| --- |" + " ---: |" * (len(held) + 1)]
    for key, mean in means.items():
        lines.append(f"| {key} | " + " | ".join(f"{float(grid[key][t].get(metric)):.2f}" for t in held)
                     + f" | {mean:.2f} |")
    with (out / "table.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    return {"held_out": held, "metric": metric, "mean": means}


def per_example(examples: dict[str, dict[str, list[float]]], canonical: dict[str, str],
                client_tasks: dict[str, str], metric: str, ttp_limit: int | None) -> dict[str, Any]:
    """Each client's per-example scores behind its Personalization and TTP cells, for paired comparisons.

    Args:
        examples: target key -> task -> each example's metric, in test-set order.
        canonical: target key -> the key whose answers it shares (one generation per served target).

    Returns:
        ``personalization``: client -> its model's scores on its own task (absent where the test set lacks
        the task); ``ttp``: client -> task -> its model's scores on the examples the TTP column averages
        (the first ``ttp_limit`` of each task, or all). Each list is in test-set order, so two runs scored
        on the same test set pair example by example.
    """
    own = {c: examples[canonical[c]][t] for c, t in client_tasks.items() if t in examples[canonical[c]]}
    ttp = {c: {t: v[:ttp_limit] if ttp_limit is not None else v for t, v in examples[canonical[c]].items()}
           for c in client_tasks}
    return {"metric": metric, "personalization": own, "ttp": ttp}
