"""Checks a client's reply before it reaches aggregation: the right tensors, finite, a plausible size.

One malformed or hostile reply must cost that client its round, never the run, and must never reach the
global adapter: an extra or missing key, a wrong shape or dtype, a NaN or inf, a negative or absurd
``num_examples``, a metric that is not a finite number. :func:`reply_problem` names the first thing
wrong with a reply (the round loop, :mod:`training.federation.rounds`, records it in the client's metrics
row and leaves the client out); the method's own layout rules come from
:meth:`training.protocol.Strategy.check_upload`, whose default is :func:`training.protocol.layout_problem`
against the state the client was sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from training.protocol import FitIns, FitRes, Strategy


def finite_problem(state: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``state`` holds a NaN or an infinity (naming the first such tensor), or None."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            return f"{key} is a {type(value).__name__}, not a tensor"
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            return f"{key} holds {bad} NaN or infinite value(s)"
    return None


def reply_problem(res: FitRes, ins: FitIns, strategy: Strategy, client_id: str, max_examples: int) -> str | None:
    """The first reason not to aggregate ``res``, or None when it may be aggregated.

    Args:
        res: what the client uploaded.
        ins: what it was sent this round.
        strategy: the method's server half (its :meth:`~training.protocol.Strategy.check_upload`).
        client_id: the client the reply is for.
        max_examples: the client's training examples (the most ``num_examples`` can honestly be).
    """
    if res.client_id != client_id:
        return f"reply names client {res.client_id!r}"
    n = res.num_examples
    if isinstance(n, bool) or not isinstance(n, int):
        return f"num_examples is a {type(n).__name__}, not an int"
    if not 1 <= n <= max(1, max_examples):
        return f"num_examples {n} is outside [1, {max(1, max_examples)}] (the client's training examples)"
    if not isinstance(res.state, Mapping):
        return f"state is a {type(res.state).__name__}, not a mapping of tensors"
    for key, value in res.metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"metric {key!r} is {value!r}, not a finite number"
    problem = strategy.check_upload(ins, res)
    if problem is not None:
        return problem
    return finite_problem(res.state)
