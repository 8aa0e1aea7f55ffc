"""Calibrated FedDPA weighting: centred similarity, mapped per client (paper 000 section 4.3, improved).

The paper's weight ``a = lambda * mean cos(w_x, w_{x_i})`` compares final-layer last-token states, and
those share one dominant direction: any two prompts of one model are at cosine 0.9 or more, so ``a``
hardly moves between a client's own task and any other (0.49 vs 0.44 at lambda 0.5). The
calibrated rule keeps the paper's idea (similarity to the client's own instances, computed with the
global adapter on) and fixes the estimator:

1. **Centre** (the cosine statistics) every state on ``mu``, the mean state of public background
   prompts (:mod:`routing.background`) under the same global adapter, which removes the shared direction.
2. **Score** a prompt against the client's instances. ``mahalanobis`` (the default since format 2) is minus
   the squared Mahalanobis distance to a shrunk Gaussian fitted to the instances
   (:mod:`routing.gaussian`): it scores the prompt's whole offset from the client's data, where a
   cosine sees only the direction of the client's mean, so another task lying along that direction is
   no longer taken for the client's own (on FedDPA dataset 1 the text-formatting client gave 95 % of
   other-task prompts a non-zero weight by the centroid score, none by this one). ``centroid`` is the
   mean centred cosine over *all* N instances (one dot product with the mean of the centred unit
   vectors); ``knn`` averages the ``k`` largest. Both centre on ``mu`` first; the Gaussian has its own mean.
3. **Map** the score with the client's own calibration, computed when the index is built from the
   client's instances' held-out scores (5-fold for the Gaussian, whose fit would otherwise have seen
   them; leave-one-out for the cosines) and ``b``, a high quantile of the background prompts' scores. The
   Gaussian's map is a conformal p-value (Bates et al., Annals of Statistics 2023): ``p`` is the share
   of held-out own scores at most ``s``, and ``a = lambda * min(1, p / q)``, so a prompt at least as
   typical as the client's ``q`` quantile gets ``lambda`` and one less typical than every own instance
   gets 0; any prompt no closer than the ``guard`` quantile of the generic prompts' scores (``s <= b``)
   gets 0. Each client chooses ``q`` and ``guard`` on a validation split of its own training prompts
   against the background (:mod:`routing.selection`; the first values, 0.25 and 0.98, had been read off
   test prompts and remain only for clients too small to split).
   The cosines' map is a ramp between ``o``, the held-out scores' lower quartile, and ``b`` (there the
   highest background score):
   ``a = lambda * clip((s - b) / (o - b), 0, 1)`` (docs/feddpa-weighting.md).
4. **Gate** ``lambda`` by the client's ``gain`` (format 3): 0 unless the client's local adapter, mixed in,
   answered its held-out examples better than the global adapter alone at the end of training, by a
   higher mean and a sign test (``training.federation.local_gate``); 1 when it did, or without a check.

Only the client's own instances and public prompts enter a calibration, so it keeps the isolation of
the index it sits beside (``embeddings.calibration.json``); a fingerprint of the instance vectors
ties it to that index.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from routing.base import RoutingError
from routing.gaussian import Gaussian, held_out_sq_distances, ledoit_wolf_shrinkage
from routing.selection import DEFAULT_GUARD, DEFAULT_OWN, select_constants

CALIBRATION_FILE = "embeddings.calibration.json"
FORMAT = 3  # formats 1 (centroid / knn only, no shrinkage) and 2 (no gate: gain 1) are still read
Statistic = Literal["mahalanobis", "centroid", "knn"]
STATISTICS: tuple[str, ...] = ("mahalanobis", "centroid", "knn")
GUARD_QUANTILE = DEFAULT_GUARD  # the guard quantile a client keeps when it is too small to choose its own
Scorer = Callable[[np.ndarray], np.ndarray]  # (Q, H) raw states -> (Q,) scores, higher = more typical
_CHUNK = 1024  # rows of the leave-one-out similarity matrix held at once


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def fingerprint(vectors: np.ndarray) -> str:
    """A short hash of an index's raw vectors: a calibration is valid only for the vectors it was built on."""
    raw = np.ascontiguousarray(vectors, dtype=np.float32)
    return hashlib.sha256(raw.tobytes() + str(raw.shape).encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class Calibration:
    """One client's calibration of its routing score (the Gaussian's, or a centred cosine's).

    Attributes:
        center: (H,) background mean subtracted from every state by the cosine statistics; the
            Gaussian's mean for ``mahalanobis`` (reported: a server refits it from the index).
        own: reference score of the client's own prompts (``own_quantile`` of its held-out scores).
        background: reference score of unrelated prompts (``background_quantile`` of the background scores).
        statistic: ``mahalanobis`` (minus the squared distance to the instances' Gaussian), ``centroid``
            (mean centred cosine over every instance) or ``knn`` (mean of the ``k`` nearest).
        k: neighbours averaged by ``knn``.
        fingerprint: :func:`fingerprint` of the instance vectors this was computed from.
        summary: quantiles of the own and background scores and the set sizes (reported, not used).
        shrinkage: the Gaussian's covariance shrinkage (``mahalanobis`` only; fixed here so that a
            refit from the same vectors is the fit the references were computed with).
        own_scores: the held-out own scores, ascending, of the conformal map (``mahalanobis``; empty:
            the ramp between ``background`` and ``own``).
        own_quantile: the share ``q`` of own scores below the level that gets the full ``lambda``.
        gain: the client's gate on ``lambda`` (0 or 1): 0 unless its local adapter did better than the
            global alone on its held-out examples at the end of training (``training.federation.local_gate``), so
            that the client is served the global adapter; 1 when it did, or without a check.
        gate: what the gate measured (mean scores per weight, wins, losses, sign-test p, examples,
            metric; empty: no check).
    """

    center: np.ndarray
    own: float
    background: float
    statistic: Statistic = "mahalanobis"
    k: int = 5
    fingerprint: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    shrinkage: float = 0.0
    own_scores: tuple[float, ...] = ()
    own_quantile: float = 0.25
    gain: float = 1.0
    gate: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        center = np.asarray(self.center, dtype=np.float32)
        if center.ndim != 1 or not np.isfinite(center).all():
            raise RoutingError(f"calibration center must be a finite (H,) vector, got shape {center.shape}")
        if not (math.isfinite(self.own) and math.isfinite(self.background)):
            raise RoutingError("calibration references must be finite")
        if self.statistic not in STATISTICS or self.k < 1:
            raise RoutingError(f"calibration statistic must be one of {', '.join(STATISTICS)} with k >= 1, got "
                               f"{self.statistic!r}, k={self.k}")
        if not (math.isfinite(self.shrinkage) and 0.0 <= self.shrinkage <= 1.0):
            raise RoutingError(f"calibration shrinkage must be in [0, 1], got {self.shrinkage}")
        if not (0.0 <= self.own_quantile <= 1.0) or not all(math.isfinite(v) for v in self.own_scores):
            raise RoutingError("calibration own scores must be finite and own_quantile in [0, 1]")
        if isinstance(self.gain, bool) or not isinstance(self.gain, int | float) \
                or not (math.isfinite(self.gain) and 0.0 <= self.gain <= 1.0):
            raise RoutingError(f"calibration gain must be in [0, 1], got {self.gain!r}")
        object.__setattr__(self, "center", center)
        object.__setattr__(self, "own_scores", tuple(sorted(float(v) for v in self.own_scores)))

    def centred(self, vectors: np.ndarray) -> np.ndarray:
        """Unit vectors of ``vectors - center`` ((N, H) or (H,))."""
        return _unit(np.asarray(vectors, dtype=np.float32) - self.center)

    def scorer(self, instances: np.ndarray) -> Scorer:
        """The per-request score against ``instances`` (N, H), with its per-index work done once here.

        ``mahalanobis`` fits the Gaussian (one eigendecomposition of the instances' Gram matrix); the cosine statistics
        centre and normalise the instances. The returned function maps (Q, H) raw states to (Q,).
        """
        if self.statistic == "mahalanobis":
            gaussian = Gaussian.fit(instances, self.shrinkage)
            return lambda queries: -gaussian.sq_distance(np.atleast_2d(queries))
        unit_x = np.ascontiguousarray(self.centred(instances))
        return lambda queries: scores(self.centred(np.atleast_2d(queries)), unit_x, self.statistic, self.k)

    def weight(self, score: float, lambda_: float, gated: bool = True) -> float:
        """The local weight ``a`` of a prompt with this ``score`` (module docstring, step 3).

        Conformal map (``own_scores`` set): 0 when ``score <= background``, else ``lambda * min(1, p /
        own_quantile)`` with ``p`` the share of own scores ``<= score``. Ramp: ``lambda * clip((score -
        background) / (own - background), 0, 1)``; when the client's own prompts score no higher than
        the background (nothing to separate), any score above the background gets the full ``lambda``.
        Either is scaled by the client's ``gain`` (``gated``; without it, the weight the scores alone give).
        """
        lambda_ = lambda_ * self.gain if gated else lambda_
        if self.own_scores:
            if score <= self.background:
                return 0.0
            n = len(self.own_scores)
            p = bisect.bisect_right(self.own_scores, score) / n
            return float(lambda_ * min(1.0, p / max(self.own_quantile, 1.0 / n)))
        span = max(self.own - self.background, 1e-6)
        return float(lambda_ * min(max((score - self.background) / span, 0.0), 1.0))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (the ``embeddings.calibration.json`` file)."""
        return {"format": FORMAT, "statistic": self.statistic, "k": self.k, "own": self.own,
                "background": self.background, "shrinkage": self.shrinkage, "fingerprint": self.fingerprint,
                "own_quantile": self.own_quantile, "own_scores": list(self.own_scores), "summary": self.summary,
                "gain": self.gain, "gate": self.gate,
                "center": [float(x) for x in self.center]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_json` (formats 1 and 2 too); raises RoutingError on another format or missing fields."""
        if not isinstance(data, dict) or data.get("format") not in (1, 2, FORMAT):
            raise RoutingError(f"not a format-1, 2 or {FORMAT} FedDPA calibration")
        if data["format"] == 1 and data.get("statistic") not in ("centroid", "knn"):
            raise RoutingError("a format-1 FedDPA calibration has statistic centroid or knn, got "
                               f"{data.get('statistic')!r}")
        try:
            return cls(np.asarray(data["center"], dtype=np.float32), float(data["own"]), float(data["background"]),
                       data["statistic"], int(data["k"]), str(data["fingerprint"]), dict(data.get("summary", {})),
                       float(data.get("shrinkage", 0.0)), tuple(float(v) for v in data.get("own_scores", ())),
                       float(data.get("own_quantile", 0.25)),
                       float(data["gain"]) if data["format"] >= 3 else 1.0, dict(data.get("gate") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise RoutingError(f"malformed FedDPA calibration: {exc}") from exc

    def save(self, folder: Path) -> Path:
        """Write ``folder/embeddings.calibration.json``; returns its path."""
        path = Path(folder) / CALIBRATION_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)  # atomic: a server reading the folder never sees half a file
        return path

    @classmethod
    def load(cls, folder: Path) -> Calibration | None:
        """Read ``folder/embeddings.calibration.json``; None when there is none."""
        path = Path(folder) / CALIBRATION_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RoutingError(f"{path} is not readable JSON: {exc}") from exc
        return cls.from_json(data)


def scores(unit_queries: np.ndarray, unit_instances: np.ndarray, statistic: Statistic, k: int,
           exclude_self: bool = False) -> np.ndarray:
    """Score centred unit queries (Q, H) against centred unit instances (N, H): (Q,).

    ``exclude_self`` scores the instances against the others (leave-one-out): query i is instance i.
    """
    n = unit_instances.shape[0]
    if statistic == "centroid":
        total = unit_instances.sum(axis=0)  # (H,)
        if exclude_self:
            return np.einsum("qh,qh->q", unit_queries, total[None, :] - unit_instances) / max(n - 1, 1)
        return unit_queries @ (total / n)
    out = np.empty(unit_queries.shape[0], dtype=np.float32)
    for start in range(0, unit_queries.shape[0], _CHUNK):
        sims = unit_queries[start:start + _CHUNK] @ unit_instances.T  # (chunk, N)
        if exclude_self:
            rows = np.arange(sims.shape[0])
            sims[rows, start + rows] = -np.inf
        kk = min(k, n - 1 if exclude_self else n)
        top = -np.partition(-sims, kk - 1, axis=1)[:, :kk] if kk < sims.shape[1] else sims
        out[start:start + len(sims)] = top.mean(axis=1)
    return out


def calibrate(instances: np.ndarray, background: np.ndarray, statistic: Statistic = "mahalanobis", k: int = 5,
              background_quantile: float | None = None, background_id: str = "", own_quantile: float | None = None,
              shrinkage: float | None = None) -> Calibration:
    """Calibrate one client from its instance states and the background prompts' states.

    Args:
        instances: (N, H) the client's local-instance states (its index), N >= 2.
        background: (M, H) public background prompts' states under the same global adapter, M >= 2.
        statistic: ``mahalanobis`` (default), ``centroid`` or ``knn``.
        k: neighbours for ``knn``.
        background_quantile: which quantile of the background scores maps to ``a = 0`` (1: the highest).
            None with ``own_quantile`` None, for ``mahalanobis``: both are chosen on the client's validation
            split (:func:`routing.selection.select_constants`, recorded as ``summary["selection"]``); None
            alone: 0.98 for ``mahalanobis`` (a generic prompt of the client's own task, such as the
            background's capital-city question for a capitals client, must not zero its own prompts), 1 for
            the cosine statistics (their first calibrations).
        background_id: name of the background set (stored in the summary).
        own_quantile: which quantile of the held-out own scores maps to ``a = lambda`` (None: chosen with
            the guard as above, else 0.25).
        shrinkage: the Gaussian's covariance shrinkage (None: the Ledoit-Wolf estimate of the instances).

    Raises:
        RoutingError: too few vectors, mismatched widths, a quantile or shrinkage outside [0, 1].
    """
    instances, background = np.asarray(instances, np.float32), np.asarray(background, np.float32)
    if instances.ndim != 2 or background.ndim != 2 or instances.shape[1] != background.shape[1]:
        raise RoutingError(f"instances (N, H) and background (M, H) must share H, got {instances.shape} "
                           f"and {background.shape}")
    if len(instances) < 2 or len(background) < 2:
        raise RoutingError("calibration needs at least 2 instances and 2 background prompts")
    selection = None
    if statistic == "mahalanobis" and background_quantile is None and own_quantile is None:
        selection = select_constants(instances, background)
        background_quantile, own_quantile = selection.guard_quantile, selection.own_quantile
    if background_quantile is None:
        background_quantile = GUARD_QUANTILE if statistic == "mahalanobis" else 1.0
    if own_quantile is None:
        own_quantile = DEFAULT_OWN
    if not (0.0 <= background_quantile <= 1.0 and 0.0 <= own_quantile <= 1.0):
        raise RoutingError(f"quantiles must be in [0, 1], got {background_quantile} and {own_quantile}")
    if statistic not in STATISTICS:
        raise RoutingError(f"calibration statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    if shrinkage is not None and not 0.0 <= shrinkage <= 1.0:
        raise RoutingError(f"shrinkage must be in [0, 1], got {shrinkage}")
    g = 0.0
    if statistic == "mahalanobis":
        g = ledoit_wolf_shrinkage(instances) if shrinkage is None else float(shrinkage)
        gaussian = Gaussian.fit(instances, g)
        g = gaussian.shrinkage  # the fit floors it above 0; the stored value must refit identically
        center = gaussian.mean
        own = -held_out_sq_distances(instances, g)
        bg = -gaussian.sq_distance(background)
    else:
        center = background.mean(axis=0)
        unit_x, unit_b = _unit(instances - center), _unit(background - center)
        own = scores(unit_x, unit_x, statistic, k, exclude_self=True)
        bg = scores(unit_b, unit_x, statistic, k)
    qs = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
    summary = {"n_instances": len(instances), "n_background": len(background), "background_id": background_id,
               "background_quantile": background_quantile, "own_quantile": own_quantile,
               "own_quantiles": {str(q): float(np.quantile(own, q)) for q in qs},
               "background_quantiles": {str(q): float(np.quantile(bg, q)) for q in qs}}
    if selection is not None:
        summary["selection"] = selection.asdict()
    o, b = float(np.quantile(own, own_quantile)), float(np.quantile(bg, background_quantile))
    if statistic == "mahalanobis":  # conformal map: overlap only means fewer own prompts clear the guard
        summary["own_above_background"] = float((own > b).mean())
        return Calibration(center, o, b, statistic, k, fingerprint(instances), summary, g,
                           tuple(float(v) for v in own), own_quantile)
    if o <= b:  # the extremes overlap: ramp between the medians instead of a step
        o, b = float(np.median(own)), float(np.median(bg))
        summary["note"] = "own and background scores overlap at the chosen quantiles; medians used"
    return Calibration(center, o, b, statistic, k, fingerprint(instances), summary, g)
