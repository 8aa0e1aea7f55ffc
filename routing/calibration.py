"""Calibrated FedDPA weighting: centred similarity, mapped per client (paper 000 section 4.3, improved).

The paper's weight ``a = lambda * mean cos(w_x, w_{x_i})`` compares final-layer last-token states, and
those share one dominant direction: any two prompts of one model are at cosine 0.9 or more, so ``a``
hardly moves between a client's own task and any other (issue 19: 0.49 vs 0.44 at lambda 0.5). The
calibrated rule keeps the paper's idea (similarity to the client's own instances, computed with the
global adapter on) and fixes the estimator:

1. **Centre** every state on ``mu``, the mean state of public background prompts
   (:mod:`routing.background`) under the same global adapter, which removes the shared direction.
2. **Score** a prompt by its mean centred cosine to the client's instances. ``centroid`` (default)
   averages over *all* N instances, which equals one dot product with the mean of the centred unit
   vectors (the paper's mean with S = N: no sampling noise, O(H) per request); ``knn`` averages the
   ``k`` largest.
3. **Map** the score with the client's own calibration, computed when the index is built: ``o`` is the
   lower quartile of the client's instances' scores against the others (leave-one-out), ``b`` the
   highest score of a background prompt. ``a = lambda * clip((s - b) / (o - b), 0, 1)``: a prompt
   typical of the client's data gets ``lambda``, one no closer than any generic prompt gets 0. (On
   FedDPA dataset 1 with SmolLM2 these defaults gave the sharpest split of the quantiles tried:
   README, "Instance-wise weighting".)

Only the client's own instances and public prompts enter a calibration, so it keeps the isolation of
the index it sits beside (``embeddings.calibration.json``); a fingerprint of the instance vectors
ties it to that index.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from routing.base import RoutingError

CALIBRATION_FILE = "embeddings.calibration.json"
FORMAT = 1
Statistic = Literal["centroid", "knn"]
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
    """One client's calibration of the centred similarity score.

    Attributes:
        center: (H,) background mean subtracted from every state.
        own: reference score of the client's own prompts (``own_quantile`` of its leave-one-out scores).
        background: reference score of unrelated prompts (``background_quantile`` of the background scores).
        statistic: ``centroid`` (mean over every instance) or ``knn`` (mean of the ``k`` nearest).
        k: neighbours averaged by ``knn``.
        fingerprint: :func:`fingerprint` of the instance vectors this was computed from.
        summary: quantiles of the own and background scores and the set sizes (reported, not used).
    """

    center: np.ndarray
    own: float
    background: float
    statistic: Statistic = "centroid"
    k: int = 5
    fingerprint: str = ""
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        center = np.asarray(self.center, dtype=np.float32)
        if center.ndim != 1 or not np.isfinite(center).all():
            raise RoutingError(f"calibration center must be a finite (H,) vector, got shape {center.shape}")
        if not (math.isfinite(self.own) and math.isfinite(self.background)):
            raise RoutingError("calibration references must be finite")
        if self.statistic not in ("centroid", "knn") or self.k < 1:
            raise RoutingError(f"calibration statistic must be 'centroid' or 'knn' with k >= 1, got "
                               f"{self.statistic!r}, k={self.k}")
        object.__setattr__(self, "center", center)

    def centred(self, vectors: np.ndarray) -> np.ndarray:
        """Unit vectors of ``vectors - center`` ((N, H) or (H,))."""
        return _unit(np.asarray(vectors, dtype=np.float32) - self.center)

    def weight(self, score: float, lambda_: float) -> float:
        """``lambda * clip((score - background) / (own - background), 0, 1)``.

        When the client's own prompts score no higher than the background (nothing to separate), any
        score above the background gets the full ``lambda``.
        """
        span = max(self.own - self.background, 1e-6)
        return float(lambda_ * min(max((score - self.background) / span, 0.0), 1.0))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (the ``embeddings.calibration.json`` file)."""
        return {"format": FORMAT, "statistic": self.statistic, "k": self.k, "own": self.own,
                "background": self.background, "fingerprint": self.fingerprint, "summary": self.summary,
                "center": [float(x) for x in self.center]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_json`; raises RoutingError on another format or missing fields."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RoutingError(f"not a format-{FORMAT} FedDPA calibration")
        try:
            return cls(np.asarray(data["center"], dtype=np.float32), float(data["own"]), float(data["background"]),
                       data["statistic"], int(data["k"]), str(data["fingerprint"]), dict(data.get("summary", {})))
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


def calibrate(instances: np.ndarray, background: np.ndarray, statistic: Statistic = "centroid", k: int = 5,
              background_quantile: float = 1.0, background_id: str = "", own_quantile: float = 0.25) -> Calibration:
    """Calibrate one client from its instance states and the background prompts' states.

    Args:
        instances: (N, H) the client's local-instance states (its index), N >= 2.
        background: (M, H) public background prompts' states under the same global adapter, M >= 2.
        statistic: ``centroid`` or ``knn``.
        k: neighbours for ``knn``.
        background_quantile: which quantile of the background scores maps to ``a = 0`` (1: the highest).
        background_id: name of the background set (stored in the summary).
        own_quantile: which quantile of the leave-one-out own scores maps to ``a = lambda``.

    Raises:
        RoutingError: too few vectors, mismatched widths or a quantile outside [0, 1].
    """
    instances, background = np.asarray(instances, np.float32), np.asarray(background, np.float32)
    if instances.ndim != 2 or background.ndim != 2 or instances.shape[1] != background.shape[1]:
        raise RoutingError(f"instances (N, H) and background (M, H) must share H, got {instances.shape} "
                           f"and {background.shape}")
    if len(instances) < 2 or len(background) < 2:
        raise RoutingError("calibration needs at least 2 instances and 2 background prompts")
    if not (0.0 <= background_quantile <= 1.0 and 0.0 <= own_quantile <= 1.0):
        raise RoutingError(f"quantiles must be in [0, 1], got {background_quantile} and {own_quantile}")
    center = background.mean(axis=0)
    unit_x, unit_b = _unit(instances - center), _unit(background - center)
    own = scores(unit_x, unit_x, statistic, k, exclude_self=True)
    bg = scores(unit_b, unit_x, statistic, k)
    qs = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
    summary = {"n_instances": len(instances), "n_background": len(background), "background_id": background_id,
               "background_quantile": background_quantile, "own_quantile": own_quantile,
               "own_quantiles": {str(q): float(np.quantile(own, q)) for q in qs},
               "background_quantiles": {str(q): float(np.quantile(bg, q)) for q in qs}}
    o, b = float(np.quantile(own, own_quantile)), float(np.quantile(bg, background_quantile))
    if o <= b:  # the extremes overlap: ramp between the medians instead of a step
        o, b = float(np.median(own)), float(np.median(bg))
        summary["note"] = "own and background scores overlap at the chosen quantiles; medians used"
    return Calibration(center, o, b, statistic, k,
                       fingerprint(instances), summary)
