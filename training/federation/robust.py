"""Robust aggregation for the FedAvg family: update-norm clipping, then the mean, the coordinate-wise
median or the trimmed mean of the clients' updates.

Off by default (the plain weighted average of :mod:`training.federation.aggregate`). For faulty or adversarial
clients the method options turn it on:

* ``clip_norm`` (float): each client's update ``upload - sent`` is scaled down to at most this L2 norm
  (over all its tensors), so one client moves the global adapter by at most ``clip_norm / n``;
* ``aggregator``: ``mean`` (weighted as the method weights), ``median`` (coordinate-wise, unweighted;
  the mean of the two middle values for an even count) or ``trimmed_mean`` (coordinate-wise, unweighted:
  the ``trim`` share of the values at each end dropped before averaging);
* ``trim`` (float in [0, 0.5)): the share dropped at each end by ``trimmed_mean`` (default 0.2; at least
  one value each end whenever ``trim > 0`` and three or more clients answer).

A median of n clients resists up to ``ceil(n/2) - 1`` arbitrary uploads; clipping alone bounds their
pull. Uploads that are not finite never get here (:mod:`training.federation.validation` rejects them first).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from training.options import Option
from training.protocol import FitRes
from training.state import StateDict

Aggregator = Literal["mean", "median", "trimmed_mean"]
# robust aggregation's options, opt-in (absent: the plain weighted average), for every FedAvg-family method
OPTIONS = (
    Option("clip_norm", float, None, "largest L2 norm of one client's update (null: no clipping)", low=0,
           open_low=True, nullable=True, listed=False),
    Option("aggregator", str, "mean", "how uploads are combined", choices=("mean", "median", "trimmed_mean"),
           listed=False),
    Option("trim", float, 0.2, "share of values dropped at each end by trimmed_mean", low=0, high=0.5,
           open_high=True, listed=False),
)


@dataclass(frozen=True)
class RobustConfig:
    """How uploads are combined.

    Attributes:
        clip_norm: largest L2 norm of one client's update (None: no clipping).
        aggregator: ``mean``, ``median`` or ``trimmed_mean``.
        trim: share of values dropped at each end by ``trimmed_mean``.
    """

    clip_norm: float | None = None
    aggregator: Aggregator = "mean"
    trim: float = 0.2

    def __post_init__(self) -> None:
        if self.aggregator not in ("mean", "median", "trimmed_mean"):
            raise ValueError(f"aggregator must be mean, median or trimmed_mean, got {self.aggregator!r}")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a positive number, got {self.clip_norm}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")

    @property
    def active(self) -> bool:
        """Whether anything differs from the plain weighted average."""
        return self.clip_norm is not None or self.aggregator != "mean"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RobustConfig:
        """Read ``clip_norm``, ``aggregator`` and ``trim`` from a method's options (absent: the defaults)."""
        clip = options.get("clip_norm")
        return cls(clip_norm=None if clip is None else float(clip), aggregator=options.get("aggregator", "mean"),
                   trim=float(options.get("trim", 0.2)))


def clip_update(update: Mapping[str, torch.Tensor], clip_norm: float) -> StateDict:
    """``update`` scaled to L2 norm at most ``clip_norm`` (float64; unchanged when already within)."""
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in update.values()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {k: v.double() * scale for k, v in update.items()}


def _combine(stack: torch.Tensor, weights: torch.Tensor, cfg: RobustConfig) -> torch.Tensor:
    """Combine ``stack`` (clients first) along dim 0."""
    n = stack.shape[0]
    if cfg.aggregator == "mean":
        w = weights / weights.sum()
        return (stack * w.reshape(-1, *([1] * (stack.dim() - 1)))).sum(0)
    ordered = stack.sort(dim=0).values
    if cfg.aggregator == "median":
        lo, hi = (n - 1) // 2, n // 2
        return (ordered[lo] + ordered[hi]) / 2
    k = math.floor(cfg.trim * n)
    if cfg.trim > 0 and n >= 3:
        k = max(1, k)
    k = min(k, (n - 1) // 2)
    return ordered[k:n - k].mean(0)


def robust_aggregate(results: Sequence[FitRes], sent: Mapping[str, torch.Tensor], weights: Sequence[float],
                     cfg: RobustConfig) -> StateDict | None:
    """The new state ``sent + combine(clip(upload_i - sent))`` key by key, in ``sent``'s dtypes.

    Args:
        results: the round's (validated) uploads, each with the keys of ``sent``.
        sent: the state every client trained from.
        weights: the method's aggregation weights (used by ``mean`` only).
        cfg: clipping and aggregator.

    Returns:
        The new state, or None when there are no uploads.
    """
    if not results:
        return None
    updates = []
    for res in results:
        delta = {k: res.state[k].detach().cpu().double() - sent[k].detach().cpu().double() for k in sent}
        updates.append(clip_update(delta, cfg.clip_norm) if cfg.clip_norm is not None else delta)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    return {k: (sent[k].detach().cpu().double() + _combine(torch.stack([u[k] for u in updates]), w, cfg)).to(
        sent[k].dtype) for k in sent}
