"""``table1.md``: a folder's cells as mean ± std over seeds, per-task blocks, per-cell figures, losses.

The Markdown a results folder commits and its README shows (:mod:`.results`): the summary with
Personalization and TTP (paper 000 section 5.2) as mean ± sample std over the seeds, each client's
column, every cell's own figures and times, paper 000's orderings pair by pair (:mod:`.orderings`),
the leave-one-task-out scores, the training losses and the bare base model's row.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from fedmosaic.reproduce.cells import LABELS, Cell
from fedmosaic.reproduce.orderings import ordering_lines

BLOCKS = {"personalization": "Personalization", "ttp": "TTP"}


@dataclass(frozen=True)
class Table:
    """One folder's cells tabulated (:func:`fedmosaic.reproduce.results.tabulate`).

    Attributes:
        settings: what the table's first line says (data, preset, metric, evaluation).
        names: the cells' file names (in ``cells/``; their per-example scores in ``examples/``).
        cells: the cells, in :func:`~fedmosaic.reproduce.cells.cell_order`.
        rows: one row per method and rule (:func:`aggregate`).
        orderings: paper 000's orderings, pair by pair (:func:`~fedmosaic.reproduce.orderings.ordering_rows`).
        markdown: ``table1.md`` (:func:`markdown`).
        readme: the folder's ``README.md`` (:mod:`fedmosaic.reproduce.readme`; empty until rendered).
    """

    settings: dict[str, Any]
    names: list[str]
    cells: list[Cell]
    rows: list[dict[str, Any]]
    orderings: list[dict[str, Any]]
    markdown: str
    readme: str


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (``ddof=1``; 0 for one value)."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def aggregate(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, rule), in the cells' order: mean ± std over seeds of every block's cells and average."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["method"], cell["rule"]), []).append(cell)
    rows = []
    for (method, rule), group in groups.items():
        row: dict[str, Any] = {"method": method, "label": group[0]["label"], "rule": rule,
                               "seeds": [c["seed"] for c in group]}
        for block in BLOCKS:
            present = [c[block] for c in group if block in c]
            if not present:
                continue
            columns = list(present[0]["values"])
            row[block] = {"avg": mean_std([float(p["avg"]) for p in present]),
                          "values": {col: mean_std([float(p["values"][col]) for p in present
                                                    if p["values"].get(col) is not None])
                                     for col in columns if any(p["values"].get(col) is not None for p in present)}}
        row["train_seconds"] = mean_std([float(c["train_seconds"]) for c in group if c.get("train_seconds") is not None]
                                        or [float("nan")])
        row["eval_seconds"] = mean_std([float(c["eval_seconds"]) for c in group])
        rows.append(row)
    return rows


def _pm(stat: dict[str, float] | None) -> str:
    if stat is None:
        return "–"
    # one seed has no spread to show: "± 0.00" would claim one
    return f"{stat['mean']:.2f}" if stat.get("n", 2) < 2 else f"{stat['mean']:.2f} ± {stat['std']:.2f}"


def _name(row: dict[str, Any]) -> str:
    return row["label"] + {"paper": " (paper rule)", "calibrated": " (calibrated, ours)"}.get(row["rule"], "")


def markdown(rows: list[dict[str, Any]], cells: list[dict[str, Any]], settings: dict[str, Any],
             orderings: list[dict[str, Any]] | None = None) -> str:
    """The README-ready Markdown: the summary, per-task blocks, per-cell times and the orderings' paired tests."""
    lines = [f"Data {settings['data']}, preset {settings['preset']}, {settings['metric']} x100, "
             f"{settings['evaluation']}; mean ± sample std over the seeds listed.", "",
             "| Method | Seeds | Personalization | TTP | Train s / run | Eval s / cell |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        pers, ttp = (r.get("personalization") or {}).get("avg"), (r.get("ttp") or {}).get("avg")
        lines.append(f"| {_name(r)} | {','.join(map(str, r['seeds']))} | {_pm(pers)} | {_pm(ttp)} | "
                     f"{r['train_seconds']['mean']:.0f} | {r['eval_seconds']['mean']:.0f} |")
    for block in BLOCKS:
        columns = list(dict.fromkeys(c for r in rows for c in (r.get(block) or {}).get("values", {})))
        if not columns:
            continue
        caption = {"personalization": "Personalization per client (its model on its own task; columns name "
                                      "the client's task):",
                   "ttp": "TTP per client (its model's mean over every task; columns name the client's task):"}[block]
        lines += ["", caption, "", "| Method | " + " | ".join(columns) + " | Avg |",
                  "|---|" + "---:|" * (len(columns) + 1)]
        for r in rows:
            if block in r:
                vals = [_pm(r[block]["values"].get(c)) for c in columns]
                lines.append(f"| {_name(r)} | " + " | ".join(vals) + f" | {_pm(r[block]['avg'])} |")
    lines += ["", "Per cell (training seconds are per run, shared by a run's two weighting rules; the run's "
              "global adapter alone beside its personalised models):", "",
              "| Method | Rule | Seed | Train s | Eval s | Answers made | Personalization | TTP | Global: Pers. "
              "| Global: TTP |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        glob = c.get("global") or {}
        figures = [(c.get("personalization") or {}).get("avg"), (c.get("ttp") or {}).get("avg"),
                   glob.get("personalization"), glob.get("ttp")]
        made = (c.get("answers") or {}).get("generated", "–")
        mark = "*" if c.get("eval_note") else ""
        shown = " | ".join("–" if v is None else f"{float(v):.2f}" for v in figures)
        lines.append(f"| {c['label']} | {c['rule']} | {c['seed']} | {c.get('train_seconds')} | "
                     f"{c['eval_seconds']}{mark} | {made} | {shown} |")
    notes = [c for c in cells if c.get("eval_note")]
    if notes or any("answers" in c for c in cells):
        lines += ["", "\"Answers made\" counts the answers a cell's evaluation generated (its Eval s; – where the "
                  "cell predates the count); the rest it scored were cached (the shared base answers, or an "
                  "interrupted evaluation's)." + (" Eval s marked \\* has a note:" if notes else "")]
    if notes:
        lines += [""] + [f"- {c['label']} {c['rule']} seed {c['seed']}: {c['eval_note']}." for c in notes]
    lines += ordering_lines(orderings or [], LABELS)
    lines += ood_lines(cells)
    lines += loss_lines(cells)
    lines += base_lines(cells)
    return "\n".join(lines) + "\n"


def loss_lines(cells: list[dict[str, Any]]) -> list[str]:
    """Markdown: each run's training losses (one row per method and seed; a run's weighting rules share it)."""
    runs = {(c["label"], c["seed"]): c["loss_curves"] for c in cells if c.get("loss_curves")}
    if not runs:
        return []
    keys = list(dict.fromkeys(k for curves in runs.values() for k in curves["rounds"]))
    finals = list(dict.fromkeys(k for curves in runs.values() for k in curves["finalize"]))
    lines = ["", "Training loss per run (mean over the clients; by round, then the end-of-run personalization). "
             "`loss` is what the client uploads or keeps (FedDPA-T's global step), `local_loss` FedDPA-T's local "
             "step, `finetune_loss` FedLoRA's and FedDPA-F's fine-tune; FedOA's `local_loss` includes its "
             "regulariser lambda x D, shown as `local_reg`:", "",
             "| Method | Seed | " + " | ".join(f"{k} by round" for k in keys) + "".join(f" | {k}" for k in finals)
             + " |", "|---|---|" + "---|" * (len(keys) + len(finals))]
    for (label, seed), curves in runs.items():
        by_round = [" → ".join(f"{v:.3f}" for v in curves["rounds"].get(k, [])) or "–" for k in keys]
        ends = [f"{curves['finalize'][k]:.3f}" if k in curves["finalize"] else "–" for k in finals]
        lines.append(f"| {label} | {seed} | " + " | ".join(by_round + ends) + " |")
    return lines


def ood_lines(cells: list[dict[str, Any]]) -> list[str]:
    """Markdown: the leave-one-task-out cells' scores on the tasks nobody trained on (paper 001 Table 2).

    Each cell of a run trained with ``--leave-out`` holds ``ood`` (``fedmosaic eval``'s summary): every
    target's mean over the held-out tasks. Intra-client OOD is each client's own model on them (here the
    mean, lowest and highest over the clients); inter-client OOD is the global model's.
    """
    rows = []
    for c in cells:
        ood = c.get("ood") or {}
        means = ood.get("mean") or {}
        own = [float(v) for k, v in means.items() if k not in ("global", "base")]
        if not own:
            continue
        held = ", ".join(ood.get("held_out") or [])
        glob, base = means.get("global"), means.get("base")
        rows.append(f"| {c['label']} | {c['seed']} | {held} | {statistics.fmean(own):.2f} "
                    f"({min(own):.2f}-{max(own):.2f}, {len(own)} clients) | "
                    + " | ".join("–" if v is None else f"{float(v):.2f}" for v in (glob, base)) + " |")
    if not rows:
        return []
    return ["", "Out of distribution (runs trained with `--leave-out`; paper 001's leave-one-task-out): the "
            "held-out tasks' mean score, each client's own model (intra-client; mean, lowest-highest over the "
            "clients) and the global model (inter-client):", "",
            "| Method | Seed | Held out | Clients' own models | Global | Base |", "|---|---|---|---:|---:|---:|",
            *rows]


def base_lines(cells: list[dict[str, Any]]) -> list[str]:
    """Markdown: the bare base model's Personalization and TTP, read from a cell trained on every client.

    The base answers are shared, but a run trained with ``--leave-out`` has fewer clients, so its base row
    averages fewer tasks; it is used (and says so) only when no other cell has the base row.
    """
    with_base = [c for c in cells if c.get("base")]
    full = [c for c in with_base if not (c.get("ood") or {}).get("held_out")]
    if not with_base:
        return []
    cell = (full or with_base)[0]
    base = cell["base"]
    scope = "" if full else f" (over the clients of {cell['label']}'s run without {', '.join(cell['ood']['held_out'])})"
    return ["", f"The base model without adapters: Personalization {float(base['personalization']):.2f}, "
            f"TTP {float(base['ttp']):.2f}{scope} (the same answers in every run: generated once, "
            "`<out>/base-answers/`)."]
