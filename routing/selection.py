"""Choosing the calibrated FedDPA map's constants on a validation split of a client's own data.

The calibrated weighting (:mod:`routing.calibration`, our extension of paper 000 section 4.3) maps a
prompt's Mahalanobis score to ``a = lambda * min(1, p / q)`` above a guard, ``b``, the background scores'
``guard`` quantile. Its two constants, the guard quantile and the own quantile ``q``, were first set
(0.98 and 0.25) by looking at test prompts. Here each client chooses them itself, from data it is
allowed to see, before serving: its own training prompts (its index) and the public background
prompts (:mod:`routing.background`). No other client's prompts and no test prompt enter.

Validation split: the instances are cut into ``folds`` seeded folds; for each, the Gaussian and the
held-out own scores are computed from the other folds exactly as :func:`routing.calibration.calibrate`
computes them from all instances, and the fold's instances are scored as unseen own prompts
(positives). The background is cut into two fixed halves: the guard is the quantile of one half and
the other half is scored as unseen foreign prompts (negatives), then the halves swap. A grid point's
loss is the balanced error of the soft weight, ``(mean(1 - a / lambda) over positives + mean(a / lambda)
over negatives) / 2``, averaged over the (fold, half) pairs; the lowest wins, the first in grid order on
a tie. Too few instances for two folds keeps the defaults, and the calibration says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from routing.gaussian import Gaussian, held_out_sq_distances, ledoit_wolf_shrinkage

GUARD_GRID: tuple[float, ...] = (0.9, 0.95, 0.98, 1.0)
OWN_GRID: tuple[float, ...] = (0.1, 0.25, 0.5)
FOLDS = 5
DEFAULT_GUARD = 0.98  # kept when a client has too few instances to split (the constants' first values)
DEFAULT_OWN = 0.25
_TIE = 1e-12  # losses closer than this are a tie: the earlier grid point wins


@dataclass(frozen=True)
class Selection:
    """The constants a client chose and how every grid point did.

    Attributes:
        guard_quantile: the background quantile below which ``a = 0``.
        own_quantile: the share ``q`` of own held-out scores below the level that gets ``lambda``.
        losses: ``((guard, own, loss), ...)`` in grid order (empty when nothing was selected).
        folds: validation folds of the instances (0: too few instances, defaults kept).
        n_instances: instances split.
        n_background: background prompts split.
    """

    guard_quantile: float
    own_quantile: float
    losses: tuple[tuple[float, float, float], ...]
    folds: int
    n_instances: int
    n_background: int

    def asdict(self) -> dict[str, Any]:
        """JSON-ready form (stored in the calibration's summary as ``selection``)."""
        return {"guard_quantile": self.guard_quantile, "own_quantile": self.own_quantile,
                "selected": bool(self.losses), "folds": self.folds, "n_instances": self.n_instances,
                "n_background": self.n_background, "data": "own training prompts (k-fold) vs background halves",
                "grid": [{"guard_quantile": g, "own_quantile": q, "loss": round(loss, 6)}
                         for g, q, loss in self.losses]}


def instance_folds(n: int, folds: int = FOLDS, seed: int = 0) -> list[np.ndarray]:
    """The validation folds of ``n`` instances (index arrays): a seeded permutation dealt into ``folds``."""
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(order[f::folds]) for f in range(folds)]


def background_halves(m: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Two fixed disjoint halves of ``m`` background prompts (index arrays)."""
    order = np.random.default_rng(seed).permutation(m)
    return np.sort(order[0::2]), np.sort(order[1::2])


def conformal_weights(scores: np.ndarray, own_sorted: np.ndarray, guard: float, own_quantile: float) -> np.ndarray:
    """``a / lambda`` of each score under the conformal map (:meth:`routing.calibration.Calibration.weight`)."""
    n = len(own_sorted)
    p = np.searchsorted(own_sorted, scores, side="right") / n
    w = np.minimum(1.0, p / max(own_quantile, 1.0 / n))
    return np.where(scores <= guard, 0.0, w)


def fold_count(n: int, folds: int = FOLDS) -> int:
    """Folds used for ``n`` instances: ``folds``, fewer when a fit part would hold under 2 instances per fold."""
    return min(folds, n // 3)


def select_constants(instances: np.ndarray, background: np.ndarray, guards: tuple[float, ...] = GUARD_GRID,
                     owns: tuple[float, ...] = OWN_GRID, folds: int = FOLDS, seed: int = 0) -> Selection:
    """Choose (guard quantile, own quantile) for one client on its validation split (module docstring).

    Args:
        instances: (N, H) the client's instance states (its index).
        background: (M, H) the public background prompts' states under the same adapter.
        guards: candidate guard quantiles.
        owns: candidate own quantiles.
        folds: validation folds of the instances.
        seed: the folds' permutation seed.
    """
    x = np.asarray(instances, dtype=np.float32)
    bg = np.asarray(background, dtype=np.float32)
    k = fold_count(len(x), folds)
    if k < 2 or len(bg) < 4:
        return Selection(DEFAULT_GUARD, DEFAULT_OWN, (), 0, len(x), len(bg))
    grid = [(g, q) for g in guards for q in owns]
    total = np.zeros(len(grid))
    pairs = 0
    halves = background_halves(len(bg))
    for fold in instance_folds(len(x), k, seed):
        fit = x[np.setdiff1d(np.arange(len(x)), fold)]
        # the same fit calibrate() makes from all instances, made from the fit part
        gaussian = Gaussian.fit(fit, ledoit_wolf_shrinkage(fit))
        own = np.sort(-held_out_sq_distances(fit, gaussian.shrinkage).astype(np.float64))
        positives = -gaussian.sq_distance(x[fold])
        bg_scores = -gaussian.sq_distance(bg)
        for ref, neg in (halves, halves[::-1]):
            for j, (g, q) in enumerate(grid):
                b = float(np.quantile(bg_scores[ref], g))
                miss = 1.0 - conformal_weights(positives, own, b, q)
                leak = conformal_weights(bg_scores[neg], own, b, q)
                total[j] += 0.5 * (float(np.mean(miss)) + float(np.mean(leak)))
            pairs += 1
    losses = total / pairs
    best = int(np.flatnonzero(losses <= losses.min() + _TIE)[0])
    table = tuple((g, q, float(loss)) for (g, q), loss in zip(grid, losses, strict=True))
    return Selection(grid[best][0], grid[best][1], table, k, len(x), len(bg))
