"""FedDPA's instance-wise local weight ``a`` per task: statistics and the box plot (paper 000 section 4.3).

Each routed answer records the weight its client's local adapter got. Per task, the values split into
the *own* client (the one that trained on that task) and the *other* clients, so one sees whether ``a``
is high on a client's own task and lower elsewhere. On tasks no client trained on (``fedmosaic eval
--test``, paper 000 Table 14) every client is "other": those tasks are listed as ``unseen_tasks`` and
the plot shows the other clients' boxes alone. When a client's gate (``training.federation.local_gate``) closed,
its served ``a`` is 0 whatever the prompt; the calibrated weights before the gates then get their own
plot and statistics (``before_gate``), which show what the estimator separates.
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


def weight_outputs(out: Path, weights: WeightGrid, own: Mapping[str, str],
                   before_gate: WeightGrid | None = None) -> dict[str, object]:
    """Plot ``out/feddpa_weights.png`` and return the statistics for ``results.json``.

    Args:
        out: the evaluation folder.
        weights: client -> task -> the served local weight of each answer.
        own: client -> its own task.
        before_gate: the same weights without the clients' gates (None: no gate changed any): plotted
            in ``out/feddpa_weights_before_gate.png``.

    Returns:
        ``per_task_own_client`` and ``per_task_other_clients`` (task -> stats), ``own_client`` and
        ``other_clients`` (stats over every task), ``unseen_tasks`` (no client trained on them),
        ``per_client`` (client -> task -> mean ``a``) and, with ``before_gate``, ``before_gate``: the
        same statistics of those weights.
    """
    summary = _outputs(out / "feddpa_weights.png", weights, own, "FedDPA instance-wise weight per task")
    if before_gate is not None:
        summary["before_gate"] = _outputs(out / "feddpa_weights_before_gate.png", before_gate, own,
                                          "FedDPA calibrated weight per task, before the clients' gates")
    return summary


def _outputs(path: Path, weights: WeightGrid, own: Mapping[str, str], title: str) -> dict[str, object]:
    own_a, other_a = split_own_other(weights, own)
    trained = set(own.values())
    unseen = [t for t in own_a if t not in trained]
    if unseen and len(unseen) == len(own_a):
        title += " (tasks no client trained on)"
    plots.plot_weights(own_a, path, title=title, others=other_a)
    return {"per_task_own_client": {t: stats(v) for t, v in own_a.items()},
            "per_task_other_clients": {t: stats(v) for t, v in other_a.items()},
            "own_client": stats([a for v in own_a.values() for a in v]),
            "other_clients": stats([a for v in other_a.values() for a in v]),
            "unseen_tasks": unseen,
            "per_client": {c: {t: statistics.fmean(v) for t, v in per.items() if v} for c, per in weights.items()}}
