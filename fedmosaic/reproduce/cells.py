"""The cell files of a table: their names, the settings a cell is matched on, and the order tables list them in.

A cell is one method x seed x weighting rule: ``<out>/cells/<method>__seed<k>__<rule>__<setting>.json``,
its per-example scores ``<out>/examples/`` under the same name. The name says the evaluation setting,
so cells of other settings never share a file; a table lists every cell of its folder made with the same
data, preset, metric and evaluation, whichever invocation made it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmosaic.reproduce.options import Table1Options, read_json

LABELS = {"fedit": "FedIT", "fedlora": "FedLoRA", "feddpa-f": "FedDPA-F", "feddpa-t": "FedDPA-T", "local": "Local",
          "fedoa": "FedOA", "fedmcp": "FedMCP", "fedamole": "FedAMoLE", "pfedseq": "pFedSeq",
          "centralized": "Centralized"}
RULES = {"feddpa-f": ("paper", "calibrated"), "feddpa-t": ("paper", "calibrated")}  # others: ("native",)
Cell = dict[str, Any]


def rules(method: str) -> tuple[str, ...]:
    """The weighting rules a method's run is scored with: FedDPA's two (the paper's, ours), else ``native``."""
    return RULES.get(method, ("native",))


def cell_path(out: Path, method: str, seed: int, rule: str, opts: Table1Options) -> Path:
    """Where one cell's result lives: its name says the evaluation setting, so settings never share a cell."""
    setting = f"{opts.metric}-{'all' if opts.limit is None else opts.limit}-b{opts.num_beams}-t{opts.max_new_tokens}"
    if opts.ttp_limit is not None:
        setting += f"-ttp{opts.ttp_limit}"
    if method == "fedoa" and opts.leave_out:  # trained without those tasks: another run, another cell
        setting += "-lo-" + "+".join(opts.held_out())
    return out / "cells" / f"{method}__seed{seed}__{rule}__{setting}.json"


def eval_settings(opts: Table1Options) -> dict[str, Any]:
    """The evaluation settings a cell records and is matched on (``ttp_limit`` only when given)."""
    found: dict[str, Any] = {"limit": opts.limit, "num_beams": opts.num_beams, "max_new_tokens": opts.max_new_tokens}
    if opts.ttp_limit is not None:
        found["ttp_limit"] = opts.ttp_limit
    return found


def cell_order(cell: Cell) -> tuple[int, int, int]:
    """A table's order: the methods as :data:`LABELS` lists them, each one's rules as :func:`rules`, then seeds."""
    methods = list(LABELS)
    order = rules(cell["method"])
    return (methods.index(cell["method"]) if cell["method"] in methods else len(methods),
            order.index(cell["rule"]) if cell["rule"] in order else len(order), int(cell["seed"]))


def table_cells(out: Path, opts: Table1Options) -> list[tuple[str, Cell]]:
    """Every cell of ``out`` made with ``opts``' data, preset, metric and evaluation, in :func:`cell_order`.

    Returns:
        ``(file name, cell)`` pairs: the name also finds the cell's per-example scores in ``<out>/examples/``.
    """
    want = {"preset": opts.preset, "data": opts.data, "metric": opts.metric, "eval": eval_settings(opts)}
    found: dict[tuple[str, int, str], tuple[str, Cell]] = {}
    for path in sorted((out / "cells").glob("*.json")):
        cell = read_json(path)
        if not all(cell.get(k) == v for k, v in want.items()):
            continue
        key = (cell["method"], cell["seed"], cell["rule"])
        # two runs of one key (FedOA with other held-out tasks): the one this invocation names wins
        if key not in found or path.name == cell_path(out, *key, opts).name:
            found[key] = (path.name, cell)
    return sorted(found.values(), key=lambda named: cell_order(named[1]))
