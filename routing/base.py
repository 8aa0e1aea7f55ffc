"""The routing contract: a request goes in, per-adapter weights come out (DESIGN.md, "the one contract").

Every router returns a :class:`RoutingDecision`: K adapter names and their weights, ``(K,)`` for the
whole request or ``(T, K)`` per token, plus an ``info`` dict that explains the decision (FedDPA's
``a``, the mean similarity, the sampling mode and S of paper 000 section 4.3). The engine stacks the
decisions of a batch into the ``(B, K)`` matrix that ``AdaptedModel.context.use`` applies to every
adapted layer; a zero row is the base model, a one-hot row one adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from adapters import AdapterError

if TYPE_CHECKING:
    from routing.cache import EmbeddingIndex

GLOBAL = "global"
LOCAL = "local"


class RoutingError(AdapterError):
    """A routing request or decision is malformed (unknown adapter, bad weight, bad hyper-parameter)."""


@dataclass(frozen=True, eq=False)
class RoutingDecision:
    """Adapter names and their weights for one request.

    Attributes:
        names: K unique adapter names, in the order of the last weights axis; ``()`` is the base model.
        weights: ``(K,)`` for the whole request or ``(T, K)`` per token; float32, finite, on the CPU (a
            request's few numbers; :func:`stack_decisions` puts a batch's on the model's device).
        info: why these weights (read-only): ``mode``, ``S``, ``mean_similarity``, ``lambda``, ``a``...
    """

    names: tuple[str, ...]
    weights: torch.Tensor
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = tuple(self.names)
        if any(not isinstance(n, str) or not n for n in names):
            raise RoutingError(f"adapter names must be non-empty strings, got {names}")
        if len(set(names)) != len(names):
            raise RoutingError(f"adapter names in one decision must be unique, got {names}")
        if not isinstance(self.weights, torch.Tensor):
            raise RoutingError(f"routing weights must be a torch.Tensor, got {type(self.weights).__name__}")
        weights = self.weights.detach().to("cpu", torch.float32)
        if weights.dim() not in (1, 2) or weights.shape[-1] != len(names):
            raise RoutingError(
                f"routing weights must have shape (K,) or (T, K) with K={len(names)} for {names}, "
                f"got {tuple(weights.shape)}"
            )
        if not torch.isfinite(weights).all():
            raise RoutingError(f"routing weights contain NaN or inf: {weights.tolist()}")
        # frozen: the normalised copies replace the caller's objects so later mutation cannot leak in
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    @property
    def per_token(self) -> bool:
        """True for ``(T, K)`` weights."""
        return self.weights.dim() == 2

    def row(self, batch: int = 1) -> torch.Tensor:
        """Return the request's weights repeated for ``batch`` rows: ``(batch, K)``.

        Raises:
            RoutingError: for per-token decisions (their batch form is ``(B, T, K)``).
        """
        if self.per_token:
            raise RoutingError("a per-token decision has no (B, K) row form; use its (T, K) weights")
        return self.weights.unsqueeze(0).expand(batch, -1).clone()  # (batch, K)

    def renamed(self, mapping: Mapping[str, str]) -> RoutingDecision:
        """Return the decision with names replaced (``"local"`` -> ``"alice:local"``), weights unchanged."""
        return RoutingDecision(tuple(mapping.get(n, n) for n in self.names), self.weights, self.info)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form for logs and metrics."""
        return {"names": list(self.names), "weights": self.weights.tolist(), "info": dict(self.info)}


@dataclass(frozen=True)
class RoutingInput:
    """What a router may look at for one request.

    Attributes:
        client: the requesting client's id (None for anonymous requests).
        representation: ``(H,)`` final-layer last-token state of the prompt with the global adapter on.
        index: the client's local-instance embeddings (FedDPA).
    """

    client: str | None = None
    representation: torch.Tensor | None = None
    index: EmbeddingIndex | None = None


@runtime_checkable
class Router(Protocol):
    """Turns one request into adapter weights.

    ``needs_representation`` tells the engine whether to run the extra prompt forward (with the
    global adapter on) that produces ``RoutingInput.representation`` before routing.
    """

    @property
    def needs_representation(self) -> bool: ...

    def route(self, request: RoutingInput) -> RoutingDecision: ...


def stack_decisions(decisions: Sequence[RoutingDecision],
                    device: torch.device | str = "cpu") -> tuple[tuple[str, ...], torch.Tensor]:
    """Merge per-request decisions into the batch's ``(names, (B, K))`` for ``context.use``.

    Names are the union in first-seen order; a row has zero weight for adapters it did not name.

    Args:
        decisions: one whole-request decision per batch row.
        device: where the matrix goes (the model's device: one copy instead of one per forward).

    Returns:
        The K names and the ``(B, K)`` weight matrix.

    Raises:
        RoutingError: when the list is empty or a decision is per-token.
    """
    if not decisions:
        raise RoutingError("stack_decisions needs at least one decision")
    names: dict[str, int] = {}
    for d in decisions:
        if d.per_token:
            raise RoutingError("stack_decisions takes whole-request (K,) decisions, got a (T, K) one")
        for n in d.names:
            names.setdefault(n, len(names))
    out = torch.zeros(len(decisions), len(names), device="cpu")  # (B, K), filled on the host row by row
    for b, d in enumerate(decisions):
        if d.names:
            out[b, [names[n] for n in d.names]] = d.weights.cpu()
    return tuple(names), out.to(device)


def check_fraction(value: float, what: str) -> float:
    """Return ``value`` as float if it is finite and in [0, 1], else raise naming ``what``."""
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise RoutingError(f"{what} must be a finite number in [0, 1], got {value!r}")
    return float(value)
