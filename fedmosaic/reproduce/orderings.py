"""Paper 000's orderings tested example by example: paired differences between two cells of one seed.

Paper 000 (section 5.2, Table 1) orders the methods FedIT < FedLoRA < FedDPA-F < FedDPA-T on
Personalization, says its instance-wise weighting lifts Test-Time Personalization (TTP) over FedLoRA, and
puts Local below the federated methods.
Two cells of the same seed answer the same test examples, so their difference can be read pair by pair:
for each ordering A < B and each seed this gives B - A (the table's own figures: each client's task, or
each client's tasks, weighs equally) and a 95% bootstrap interval that resamples the test examples
within each client's task. The interval measures how much the test sample alone could move the
difference; how much training moves it is the spread over seeds, shown in the row below each ordering's
seeds.

The per-example scores come from ``evaluate_run``'s ``example_scores`` (one list per client and task in
test-set order); ``fedmosaic reproduce`` keeps them in ``<out>/examples/``, one file per cell.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# (A, B, block): paper 000 says A < B. The calibrated rows are our extension's, read the same way.
ORDERINGS: tuple[tuple[tuple[str, str], tuple[str, str], str], ...] = (
    (("fedit", "native"), ("fedlora", "native"), "personalization"),
    (("fedlora", "native"), ("feddpa-f", "paper"), "personalization"),
    (("feddpa-f", "paper"), ("feddpa-t", "paper"), "personalization"),
    (("fedlora", "native"), ("feddpa-f", "calibrated"), "personalization"),
    (("feddpa-f", "calibrated"), ("feddpa-t", "calibrated"), "personalization"),
    (("fedlora", "native"), ("feddpa-f", "paper"), "ttp"),
    (("fedlora", "native"), ("feddpa-t", "paper"), "ttp"),
    (("fedlora", "native"), ("feddpa-f", "calibrated"), "ttp"),
    (("fedlora", "native"), ("feddpa-t", "calibrated"), "ttp"),
    (("local", "native"), ("fedit", "native"), "personalization"),  # Table 1 puts Local below every federated
    (("local", "native"), ("fedit", "native"), "ttp"),  # method: against the weakest of them, FedIT
)
DRAWS = 2000
Strata = dict[tuple[str, ...], list[float]]  # (client,) or (client, task) -> scores in test order


def read_examples(path: Path) -> dict[str, Any] | None:
    """A cell's per-example scores, or None (said on stderr) when the file is not what the table wrote."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        print(f"fedmosaic reproduce: {path} unreadable ({exc}); its cell is left out of the paired orderings",
              file=sys.stderr)
        return None
    if data is not None and not (isinstance(data, dict) and isinstance(data.get("personalization"), dict)
                                 and isinstance(data.get("ttp"), dict)):
        print(f"fedmosaic reproduce: {path} holds no per-example scores; its cell is left out of the paired orderings",
              file=sys.stderr)
        return None
    return data


def strata(examples: Mapping[str, Any], block: str) -> Strata:
    """A cell's per-example scores for one block, keyed by stratum: ``(client,)`` or ``(client, task)``."""
    if block == "personalization":
        return {(c,): list(v) for c, v in examples["personalization"].items()}
    return {(c, t): list(v) for c, tasks in examples["ttp"].items() for t, v in tasks.items()}


def paired_difference(a: Strata, b: Strata, draws: int = DRAWS, seed: int = 0) -> dict[str, float] | None:
    """B - A as the table computes each (the mean over clients, or clients x tasks, of stratum means).

    Each client's tasks weigh equally in TTP, so with equal strata sizes this is the table's TTP
    difference; Personalization is the mean over clients. The interval resamples each stratum's paired
    differences with replacement (``draws`` times, a fixed seed) and takes the 2.5 and 97.5 percentiles.

    Returns:
        ``{"delta", "low", "high", "n"}``, or None when the two cells were not scored on the same examples
        (other strata or other counts).
    """
    if not a or a.keys() != b.keys() or any(len(a[k]) != len(b[k]) or not a[k] for k in a):
        return None
    rng = np.random.default_rng(seed)
    weight = 1.0 / len(a)
    delta = 0.0
    resampled = np.zeros(draws)
    for key in sorted(a):
        d = np.asarray(b[key], dtype=np.float64) - np.asarray(a[key], dtype=np.float64)  # (n,)
        delta += weight * d.mean()
        idx = rng.integers(0, len(d), size=(draws, len(d)))  # (draws, n)
        resampled += weight * d[idx].mean(axis=1)
    low, high = np.percentile(resampled, [2.5, 97.5])
    return {"delta": float(delta), "low": float(low), "high": float(high), "n": sum(len(v) for v in a.values())}


def reading(diff: Mapping[str, float]) -> str:
    """``holds`` (the interval above 0), ``reversed`` (below 0) or ``tie`` (it contains 0)."""
    if diff["low"] > 0:
        return "holds"
    if diff["high"] < 0:
        return "reversed"
    return "tie"


def ordering_rows(cells: Sequence[Mapping[str, Any]], examples: Mapping[tuple[str, int, str], Any]
                  ) -> list[dict[str, Any]]:
    """One row per ordering and seed where both cells have per-example scores (seeds in ascending order)."""
    by_key = {(c["method"], c["seed"], c["rule"]): c for c in cells}
    rows = []
    for (ma, ra), (mb, rb), block in ORDERINGS:
        seeds = sorted({s for (m, s, r) in by_key if (m, r) == (ma, ra)}
                       & {s for (m, s, r) in by_key if (m, r) == (mb, rb)})
        for seed in seeds:
            ea, eb = examples.get((ma, seed, ra)), examples.get((mb, seed, rb))
            if ea is None or eb is None:
                continue
            diff = paired_difference(strata(ea, block), strata(eb, block))
            if diff is not None:
                rows.append({"a": (ma, ra), "b": (mb, rb), "block": block, "seed": seed, **diff})
    return rows


def _label(labels: Mapping[str, str], method: str, rule: str) -> str:
    return labels.get(method, method) + {"paper": " (paper)", "calibrated": " (calibrated)"}.get(rule, "")


def ordering_lines(rows: Sequence[Mapping[str, Any]], labels: Mapping[str, str]) -> list[str]:
    """The Markdown section: each ordering's paired difference by seed, then its mean ± std over the seeds."""
    if not rows:
        return []
    lines = ["", "Paper 000's orderings, example by example (B - A on the same test examples of one seed; the 95% "
             f"interval resamples the test examples within each client's task, {DRAWS} draws, so it shows the "
             "test sample's noise, and the seeds show training's):", "",
             "| Ordering (A < B) | Block | Seed | B - A | 95% interval | Reading |", "|---|---|---|---:|---|---|"]
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["a"], r["b"], r["block"]), []).append(r)
    for (a, b, block), group in groups.items():
        name = f"{_label(labels, *a)} < {_label(labels, *b)}"
        shown = {"personalization": "Pers.", "ttp": "TTP"}[block]
        for r in group:
            lines.append(f"| {name} | {shown} | {r['seed']} | {r['delta']:+.2f} | [{r['low']:+.2f}, {r['high']:+.2f}] "
                         f"| {reading(r)} |")
        if len(group) > 1:
            deltas = [r["delta"] for r in group]
            lines.append(f"| {name} | {shown} | mean of {len(group)} | {statistics.fmean(deltas):+.2f} "
                         f"± {statistics.stdev(deltas):.2f} | | {sum(reading(r) == 'holds' for r in group)} of "
                         f"{len(group)} hold |")
    return lines
