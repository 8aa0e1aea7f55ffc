"""Aggregation maths as pure functions: weighted averages of state dicts (FedAvg, McMahan et al. 2017).

FedDPA and FedOA aggregate with equal client weights ("based on client number", docs/methods.md 2.2), pFedSeq
by data size (section 4.1), FedMCP uniformly (section 5). Following Flower's policy, nothing to
aggregate yields None instead of an exception.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from training.protocol import FitRes
from training.state import StateDict

Weighting = Literal["equal", "num_examples"]


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> StateDict | None:
    """Return ``sum_i w_i s_i / sum_i w_i`` key by key (original dtype kept).

    Accumulation is in float64, so averaging identical states returns them bit for bit (an fp32 sum of
    weighted copies can be off by an ulp), and the fp32 result does not change with the upload order.

    Raises:
        ValueError: keys or shapes differ between states, weights are negative, or they sum to 0.
    """
    if not states:
        return None
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} states but {len(weights)} weights")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"aggregation weights must be >= 0 with a positive sum, got {list(weights)}")
    keys = set(states[0])
    for i, s in enumerate(states[1:], start=1):
        if set(s) != keys:
            diff = sorted(keys ^ set(s))[:3]
            raise ValueError(f"state {i} has different keys than state 0 (e.g. {diff})")
    total = float(sum(weights))
    out: StateDict = {}
    for key in states[0]:
        ref = states[0][key]
        acc = torch.zeros(ref.shape, dtype=torch.float64, device="cpu")  # the server's state lives on the CPU
        for s, w in zip(states, weights, strict=True):
            if s[key].shape != ref.shape:
                raise ValueError(f"{key}: shape {tuple(s[key].shape)} differs from {tuple(ref.shape)}")
            acc += s[key].detach().cpu().double() * (w / total)
        out[key] = acc.to(ref.dtype)
    return out


def aggregate_results(results: Sequence[FitRes], weighting: Weighting = "equal") -> StateDict | None:
    """FedAvg over uploads, weighted equally or by ``num_examples``; None when there are none."""
    if weighting not in ("equal", "num_examples"):
        raise ValueError(f"weighting must be 'equal' or 'num_examples', got {weighting!r}")
    weights = [1.0 if weighting == "equal" else float(r.num_examples) for r in results]
    return weighted_average([r.state for r in results], weights)
