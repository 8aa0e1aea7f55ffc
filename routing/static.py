"""Fixed routing decisions: one adapter, the base model, an explicit mixture, FedDPA at a fixed weight.

These cover requests that name what they want (``global``, ``<client>:local``, the base model, the API's
explicit-mixture extension field) and FedDPA without the dynamic weighting of paper 000 section 4.3
(the "w/o Auto" rows of its Table 3): ``(1 - a, a)`` over (global, local).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from routing.base import GLOBAL, Pooling, RoutingDecision, RoutingError, check_fraction, local_name


def _check_known(names: Sequence[str], known: Collection[str] | None) -> None:
    if known is None:
        return
    unknown = [n for n in names if n not in known]
    if unknown:
        raise RoutingError(f"unknown adapter(s) {unknown}; available: {sorted(known)}")


def base_model() -> RoutingDecision:
    """Return the decision for the bare base model (no adapter at all)."""
    return RoutingDecision((), torch.zeros(0), {"mode": "base"})


def single(name: str, known: Collection[str] | None = None) -> RoutingDecision:
    """Return one adapter at weight 1.

    Args:
        name: the adapter.
        known: adapter names that exist (None: skip the check).

    Raises:
        RoutingError: for an empty or unknown name.
    """
    if not isinstance(name, str) or not name:
        raise RoutingError(f"adapter name must be a non-empty string, got {name!r}")
    _check_known((name,), known)
    return RoutingDecision((name,), torch.ones(1), {"mode": "single"})


def mixture(
    names: Sequence[str],
    weights: Sequence[float] | torch.Tensor,
    known: Collection[str] | None = None,
    allow_negative: bool = False,
) -> RoutingDecision:
    """Return an explicit mixture: ``weights[k]`` on adapter ``names[k]`` (llama.cpp's ``lora`` scales).

    Weights need not sum to 1: they are per-adapter scales, as in the API's mixture field.

    Args:
        names: K adapter names, unique.
        weights: ``(K,)`` or per token ``(T, K)``.
        known: adapter names that exist (None: skip the check).
        allow_negative: accept negative weights (adapter subtraction); off by default.

    Raises:
        RoutingError: empty names, length mismatch, duplicate or unknown names, non-finite or (unless
            allowed) negative weights.
    """
    names = tuple(names)
    if not names:
        raise RoutingError("a mixture needs at least one adapter name (use base_model() for none)")
    w = weights.detach().to(torch.float64) if isinstance(weights, torch.Tensor) else None
    if w is None:
        values = list(weights)
        if len(values) != len(names):
            raise RoutingError(f"a mixture has {len(names)} names {names} but {len(values)} weights")
        if not all(isinstance(v, int | float) for v in values):
            raise RoutingError(f"mixture weights must be numbers, got {values}")
        w = torch.tensor(values, dtype=torch.float64)
    elif w.shape[-1:] != (len(names),) or w.dim() not in (1, 2):
        raise RoutingError(f"mixture weights must be (K,) or (T, K) with K={len(names)}, got {tuple(w.shape)}")
    if len(set(names)) != len(names):
        raise RoutingError(f"mixture names must be unique, got {names}")
    finite = torch.isfinite(w).reshape(-1, len(names)).all(dim=0)  # (K,)
    if not finite.all():
        k = int((~finite).nonzero()[0])
        raise RoutingError(f"mixture weights must be finite; adapter {names[k]!r} has {w[..., k].tolist()}")
    if not allow_negative and (w < 0).any():
        neg = [n for k, n in enumerate(names) if (w[..., k] < 0).any()]
        raise RoutingError(f"negative mixture weight for adapter(s) {neg}; pass allow_negative=True to allow it")
    _check_known(names, known)
    return RoutingDecision(names, w, {"mode": "mixture"})


def fixed_feddpa(a: float, client: str) -> RoutingDecision:
    """Return FedDPA at a fixed local weight: ``(1 - a, a)`` over (``global``, ``<client>:local``).

    This is FedDPA without the instance-wise weighting (paper 000 Table 3, "w/o Auto"), and the form
    a client is exported in at one ``a``.

    Raises:
        RoutingError: ``a`` outside [0, 1] or not finite.
    """
    a = check_fraction(a, "the fixed FedDPA weight a")
    return RoutingDecision((GLOBAL, local_name(client)), torch.tensor([1.0 - a, a], dtype=torch.float64),
                           {"mode": "fixed", "alpha": a, "source": "fixed"})


@dataclass(frozen=True)
class FixedWeightRouter:
    """A :class:`~routing.base.WeightRouter` giving every request of a client the run's fixed weight.

    Attributes:
        alpha: the local adapter's weight (FedDPA's ``inference_weight``), in [0, 1].
    """

    alpha: float
    uses_state: bool = field(default=False, init=False)  # no state read, so no routing pass and no pooling
    pooling: Pooling = field(default="last", init=False)

    def __post_init__(self) -> None:
        check_fraction(self.alpha, "alpha")

    def __call__(self, client: str, hidden_state: torch.Tensor | None,
                 prompt_ids: Sequence[int] | None = None) -> RoutingDecision:
        """The fixed decision for ``client`` (neither the state nor the prompt is read)."""
        return fixed_feddpa(self.alpha, client)
