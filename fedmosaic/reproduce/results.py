"""A results folder's tables: its cells tabulated, ``table1.md`` and ``README.md`` written from them.

Both files are generated, never edited: :func:`tabulate` renders them from the folder's cells (and the
per-example scores beside them), :func:`write` writes them, and :func:`rewrite` (``fedmosaic reproduce
--tables-only``) does both for a folder of committed cells without training or evaluating anything.
``tests/fedmosaic/reproduce/test_results.py`` holds the committed ``bench/results/`` folders equal to
what this renders from their cells.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from fedmosaic.reproduce import readme
from fedmosaic.reproduce.cells import table_cells
from fedmosaic.reproduce.options import Table1Options, evaluation_text, read_json
from fedmosaic.reproduce.orderings import ordering_rows, read_examples
from fedmosaic.reproduce.tables import Table, aggregate, markdown

SETTINGS = "table1_settings.json"  # the training settings every run of a folder shares (runs.check_training_settings)


def tabulate(out: Path, opts: Table1Options) -> Table:
    """Tabulate the cells of ``out`` made with ``opts``' data, preset, metric and evaluation, and its README.

    A subfolder with its own ``table1_settings.json`` and ``cells/`` is an ablation beside the table (runs
    trained otherwise, such as FedOA with ``lambda = 0``): its cells are tabulated apart, in the README.
    """
    table = _tables(out, opts)
    ablations = {path.parent.name: _tables(path.parent, with_settings(path.parent, opts))
                 for path in sorted(out.glob(f"*/{SETTINGS}")) if (path.parent / "cells").is_dir()}
    return dataclasses.replace(table, readme=readme.render(out, opts, table, ablations))


def _tables(out: Path, opts: Table1Options) -> Table:
    """The cells of ``out`` made with ``opts``' settings and their ``table1.md`` (no README)."""
    named = table_cells(out, opts)
    names, cells = [n for n, _ in named], [c for _, c in named]
    scored = {(c["method"], c["seed"], c["rule"]): out / "examples" / n for n, c in named}
    examples = {k: read_examples(p) for k, p in scored.items() if p.is_file()}
    orderings = ordering_rows(cells, examples)
    settings = {"data": opts.data, "preset": opts.preset, "metric": opts.metric, "evaluation": evaluation_text(opts)}
    rows = aggregate(cells)
    return Table(settings, names, cells, rows, orderings, markdown(rows, cells, settings, orderings), "")


def with_settings(folder: Path, opts: Table1Options) -> Table1Options:
    """``opts`` with the training settings the folder's runs were made with (its ``table1_settings.json``).

    Raises:
        SystemExit: the folder has no ``table1_settings.json`` (no cells of ``fedmosaic reproduce``).
    """
    path = folder / SETTINGS
    if not path.is_file():
        raise SystemExit(f"fedmosaic reproduce: {folder} has no {SETTINGS}: not a folder of reproduce's cells")
    recorded = read_json(path)
    keep = {k: recorded[k] for k in ("preset", "data", "rounds", "model") if k in recorded}
    lists: dict[str, Any] = {k: tuple(recorded[k]) for k in ("data_option", "option") if k in recorded}  # tuples
    return dataclasses.replace(opts, **keep, **lists)


def write(out: Path, table: Table) -> list[Path]:
    """Write ``table1.md`` and ``README.md`` into ``out`` (each atomically); returns their paths."""
    written = []
    for name, text in (("table1.md", table.markdown), ("README.md", table.readme)):
        path = out / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        written.append(path)
    return written


def rewrite(out: Path, opts: Table1Options) -> list[Path]:
    """``--tables-only``: rewrite ``out``'s ``table1.md`` and ``README.md`` from its cells; nothing is trained.

    The training settings (preset, data, model, options) are the folder's own; the evaluation setting is
    ``opts``' (``--limit``, ``--ttp-limit``, ``--num-beams``, ``--max-new-tokens``, ``--metric``).

    Raises:
        SystemExit: ``out`` has no ``table1_settings.json``, or no cell of that setting.
    """
    opts = with_settings(out, opts)
    table = tabulate(out, opts)
    if not table.cells:
        made = sorted({json.dumps(read_json(p).get("eval"), sort_keys=True)
                       for p in (out / "cells").glob("*.json")})
        raise SystemExit(f"fedmosaic reproduce: no cell in {out / 'cells'} was made with {evaluation_text(opts)} "
                         f"({opts.metric}); its cells' evaluation settings: {', '.join(made) or 'none'}: "
                         "give those options (--limit, --ttp-limit, --num-beams, --max-new-tokens)")
    return write(out, table)
