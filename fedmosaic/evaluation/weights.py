"""FedDPA's instance-wise local weight ``a`` per task: statistics and the box plot (paper 000 section 4.3).

Each routed answer records the weight its client's local adapter got. Per task, the values split into
the *own* client (the one that trained on that task) and the *other* clients, so one sees whether ``a``
is high on a client's own task and lower elsewhere. On tasks no client trained on (``fedmosaic eval
--test``, paper 000 Table 14) every client is "other": those tasks are listed as ``unseen_tasks`` and
the plot shows the other clients' boxes alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedmosaic.evaluation import plots

WeightGrid = Mapping[str, Mapping[str, Sequence[float]]]  # client -> task -> a of each answer


def stats(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and count of ``values`` (only the count when empty)."""
    if not values:
        return {"n": 0}
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "n": len(values)}


Split = dict[str, list[float]]  # task -> weights


def split_own_other(weights: WeightGrid, own: Mapping[str, str]) -> tuple[Split, Split]:
    """Per task: the weights of the client whose own task it is, and those of every other client.

    Args:
        weights: client -> task -> the local weight of each answer.
        own: client -> its own task.
    """
    tasks = sorted({t for per in weights.values() for t in per})
    own_a = {t: [a for c, per in weights.items() if own.get(c) == t for a in per.get(t, ())] for t in tasks}
    other_a = {t: [a for c, per in weights.items() if own.get(c) != t for a in per.get(t, ())] for t in tasks}
    return own_a, other_a


def weight_outputs(out: Path, weights: WeightGrid, own: Mapping[str, str]) -> dict[str, object]:
    """Plot ``out/feddpa_weights.png`` and return the statistics for ``results.json``.

    Returns:
        ``per_task_own_client`` and ``per_task_other_clients`` (task -> stats), ``own_client`` and
        ``other_clients`` (stats over every task), ``unseen_tasks`` (no client trained on them) and
        ``per_client`` (client -> task -> mean ``a``).
    """
    own_a, other_a = split_own_other(weights, own)
    trained = set(own.values())
    unseen = [t for t in own_a if t not in trained]
    title = "FedDPA instance-wise weight per task"
    if unseen and len(unseen) == len(own_a):
        title += " (tasks no client trained on)"
    plots.plot_weights(own_a, out / "feddpa_weights.png", title=title, others=other_a)
    return {"per_task_own_client": {t: stats(v) for t, v in own_a.items()},
            "per_task_other_clients": {t: stats(v) for t, v in other_a.items()},
            "own_client": stats([a for v in own_a.values() for a in v]),
            "other_clients": stats([a for v in other_a.values() for a in v]),
            "unseen_tasks": unseen,
            "per_client": {c: {t: statistics.fmean(v) for t, v in per.items() if v} for c, per in weights.items()}}
