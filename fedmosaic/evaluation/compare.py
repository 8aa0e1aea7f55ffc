"""``fedmosaic eval RUN_DIR... --compare``: several evaluated runs side by side, one row per run.

Reads each run's ``results.json`` (:func:`fedmosaic.evaluation.evaluate.evaluate_run`'s output) and lays
the runs out in paper 000 Table 1's two blocks; runs scored on other clients or tasks are refused, since
their TTP means would not compare. A run evaluated with ``--ttp-limit`` brings its TTP scores on the
limited examples (``ttp_scores``), as its own table shows them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adapters.rundir import RunDir
from fedmosaic.evaluation import tables
from fedmosaic.evaluation.evaluate import output_dir
from fedmosaic.evaluation.inputs import EvalSetupError
from training.scoring import Scores


def _grid(scores: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Scores]]:
    return {k: {t: Scores(**{**v, "n": int(v["n"])}) for t, v in ts.items()} for k, ts in scores.items()}


def compare_runs(run_dirs: Sequence[str | Path], out: Path | None = None, metric: str = "rouge1",
                 test: str | None = None) -> str:
    """Put several evaluated runs side by side (rows = runs); returns the Markdown.

    Args:
        run_dirs: evaluated run directories.
        out: where to write the Markdown too.
        metric: the metric to tabulate.
        test: compare their evaluations on this test set (``--test``; None: their own test sets).

    Raises:
        EvalSetupError: a run has no such evaluation, or the runs were scored on other tasks or clients.
    """
    per_run, columns, tasks, first = [], None, None, None
    for d in run_dirs:
        path = output_dir(RunDir(Path(d)), test) / "results.json"
        if not path.is_file():
            raise EvalSetupError(f"{d} has no evaluation{f' on test set {test!r}' if test else ''} ({path} is "
                                 "missing): run `fedmosaic eval` on it first")
        res = json.loads(path.read_text())
        grid, cut = _grid(res["scores"]), _grid(res["ttp_scores"]) if "ttp_scores" in res else None
        per_run.append(tables.block_rows(res["method"], grid, res["clients"], res["client_tasks"], metric,
                                         ttp_grid=cut))
        cols = [res["client_tasks"][c] for c in res["clients"]]
        scored = sorted({t for ts in res["scores"].values() for t in ts})
        if columns is not None and cols != columns:
            raise EvalSetupError(f"runs disagree on clients/tasks: {columns} vs {cols}")
        if tasks is not None and scored != tasks:  # TTP means over other tasks are not comparable
            raise EvalSetupError(f"runs were scored on different test tasks: {tasks} vs {scored}")
        columns, tasks, first = cols, scored, first or res
    name = ((first or {}).get("test_set") or {}).get("name")
    notes = tables.coverage_notes(first["clients"], first["client_tasks"], tasks or []) if first else []
    md = tables.markdown(tables.merge_blocks(per_run), columns or [], metric,
                         title=f"Runs on test set {name}" if name else "", notes=notes)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
    return md
