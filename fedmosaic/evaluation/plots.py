"""PNG plots of an evaluation: score per round (paper 000 Figure 3) and FedDPA weights per task.

matplotlib with the Agg backend (no display needed). Each function writes one file and returns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first


def plot_rounds(series: Mapping[str, Mapping[int, float]], metric: str, out: Path, title: str = "") -> Path:
    """Line plot of score per round, one line per series (e.g. ``global``, ``clients (avg)``)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        rounds = sorted(points)
        ax.plot(rounds, [points[r] for r in rounds], marker="o", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric} (x100)")
    ax.set_title(title or f"{metric} per round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_weights(weights: Mapping[str, Sequence[float]], out: Path, title: str = "",
                 others: Mapping[str, Sequence[float]] | None = None) -> Path:
    """Box plot of the FedDPA local-adapter weight ``a`` per task (one box per task).

    With ``others``, each task gets two boxes side by side: ``weights`` (the client whose own task it
    is) and ``others`` (every other client's personalised model on that task), so one sees whether
    ``a`` is high on the client's own task and lower on test-time tasks (paper 000 section 4.3). A
    series with no value at all (no client owns any of the tasks, on a test set of unseen tasks) is
    left out and the other one is centred on its ticks.
    """
    others = others or {}
    tasks = [t for t in dict.fromkeys([*weights, *others]) if weights.get(t) or others.get(t)]
    fig, ax = plt.subplots(figsize=(max(6, (1.4 if others else 0.8) * len(tasks) + 2), 4))
    centres = list(range(1, len(tasks) + 1))
    if others:
        drawn = [(values, colour, label) for values, colour, label in ((weights, "tab:blue", "own client"),
                                                                      (others, "tab:orange", "other clients"))
                 if any(values.get(t) for t in tasks)]
        shifts = (-0.2, 0.2) if len(drawn) == 2 else (0.0,)
        for (values, colour, label), shift in zip(drawn, shifts, strict=True):
            pos = [c + shift for c, t in zip(centres, tasks, strict=True) if values.get(t)]
            data = [list(values[t]) for t in tasks if values.get(t)]
            parts = ax.boxplot(data, positions=pos, widths=0.35, patch_artist=True, medianprops={"color": "black"})
            for box in parts["boxes"]:
                box.set_facecolor(colour)
            ax.plot([], [], color=colour, linewidth=8, label=label)
        ax.set_xticks(centres, tasks)
        ax.legend(loc="best")
    else:
        ax.boxplot([list(weights[t]) for t in tasks], tick_labels=tasks)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("local adapter weight a")
    ax.set_title(title or "FedDPA instance-wise weight per task")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_scores(grid: Mapping[str, Mapping[str, float]], out: Path, metric: str) -> Path:
    """Heatmap of model key x task scores (who is good at what)."""
    keys = list(grid)
    tasks = sorted({t for k in grid.values() for t in k})
    values = [[grid[k].get(t, float("nan")) for t in tasks] for k in keys]
    fig, ax = plt.subplots(figsize=(1.0 * len(tasks) + 3, 0.45 * len(keys) + 2))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right")
    ax.set_yticks(range(len(keys)), keys)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="white", fontsize=8)
    fig.colorbar(im, ax=ax, label=f"{metric} (x100)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
