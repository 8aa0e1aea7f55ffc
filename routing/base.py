"""The routing contract: a request goes in, per-adapter weights come out (ARCHITECTURE.md, "the one contract").

Every router returns a :class:`RoutingDecision`: K adapter names and their weights, ``(K,)`` for the
whole request or ``(T, K)`` per token, plus an ``info`` dict that explains the decision (FedDPA's
``a``, the mean similarity, the sampling mode and S of paper 000 section 4.3). A
:class:`WeightRouter` is what serving asks for a client's weights. The engine turns a batch's
decisions into the ``(B, K)`` matrix ``AdaptedModel.context.use`` applies to every adapted layer
(:func:`adapters.context.weight_matrix`, the one builder); a zero row is the base model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from adapters import AdapterError

GLOBAL = "global"  # the global adapter's name, in a run directory, a server and a decision
LOCAL_SUFFIX = ":local"  # a client's local adapter is served as ``<client>:local``
Pooling = Literal["last", "mean"]  # a prompt's representation: its last token's final-layer state, or their mean


def local_name(client: str) -> str:
    """The served name of ``client``'s local adapter."""
    return f"{client}{LOCAL_SUFFIX}"


class RoutingError(AdapterError):
    """A routing request or decision is malformed (unknown adapter, bad weight, bad hyper-parameter)."""


class StoredRoutingError(RoutingError):
    """A client's stored routing files (embedding index, calibration) cannot be used: missing, unreadable,
    malformed or stale. The fault is the run folder's, not the request's (a server answers 500)."""


@dataclass(frozen=True, eq=False)
class RoutingDecision:
    """Adapter names and their weights for one request.

    Attributes:
        names: K unique adapter names, in the order of the last weights axis; ``()`` is the base model.
        weights: ``(K,)`` for the whole request or ``(T, K)`` per token; float64 (the numbers a router
            computed, reported exactly in responses), finite, on the CPU (a
            request's few numbers; a batch's matrix is built on the model's device).
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
        weights = self.weights.detach().to("cpu", torch.float64)
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
        """Return the decision with names replaced (``"g"`` -> ``"global"``), weights unchanged."""
        return RoutingDecision(tuple(mapping.get(n, n) for n in self.names), self.weights, self.info)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form for logs and metrics."""
        return {"names": list(self.names), "weights": self.weights.tolist(), "info": dict(self.info)}


@runtime_checkable
class WeightRouter(Protocol):
    """Adapter weights for one client's request: the contract between routing and serving.

    Given the client and (when ``uses_state``) the prompt's final-layer state taken during prefill with
    the global adapter on (paper 000 section 4.3), a router returns a :class:`RoutingDecision` over
    adapter names as the server knows them (``global``, ``<client>:local``). What the engine gives a
    router is declared here, so a caller follows it from the signature:

    * ``uses_state``: the engine runs the routing pass and hands over the state only when True (else
      ``hidden_state`` is None);
    * ``pooling``: that state is the last prompt token's (``last``, the paper) or the mean over the
      prompt's tokens (``mean``, paper 000 Table 10);
    * ``prompt_ids``: the prompt's token ids, always handed over with a state; a router may key a
      seeded random choice on them (the state varies by float rounding with the batch and a reused
      prompt prefix) or ignore them.
    """

    @property
    def uses_state(self) -> bool: ...

    @property
    def pooling(self) -> Pooling: ...

    def __call__(self, client: str, hidden_state: torch.Tensor | None,
                 prompt_ids: Sequence[int] | None = None) -> RoutingDecision: ...


def check_fraction(value: float, what: str) -> float:
    """Return ``value`` as float if it is finite and in [0, 1], else raise naming ``what``."""
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise RoutingError(f"{what} must be a finite number in [0, 1], got {value!r}")
    return float(value)
