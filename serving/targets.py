"""Serving targets: turn a request's ``model`` name (or explicit mixture) into adapters and weights.

Names a request can use (the OpenAI ``model`` field):

* the base model's name: no adapter;
* ``global``, ``<client>:local`` or any adapter loaded at run time: that adapter alone at weight 1;
* ``<client>``: FedDPA's personalised model (paper 000 section 4.3), weights ``(1 - a, a)`` over
  (``global``, ``<client>:local``). With a :class:`WeightRouter` that reads the prompt, ``a`` is
  instance-wise: the engine prefills with the global adapter alone, hands the router the final-layer
  last-token state, and decodes with the router's weights. Without one, ``a`` is the run's
  ``inference_weight`` (:class:`FixedWeightRouter`);
* an explicit mixture ``[(name, weight), ...]`` (the HTTP ``adapters`` extension field) overrides all.

The router protocol is the seam to ``routing/`` (another package): any callable
``(client, hidden_state) -> (weights by adapter name, info)`` plugs in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from serving.adapter_pool import AdapterPool
from serving.errors import InvalidRequest, ModelNotFound
from serving.request import WeightFn

GLOBAL = "global"
LOCAL_SUFFIX = ":local"


class WeightRouter(Protocol):
    """Instance-wise adapter weights for one client's request.

    Attributes:
        uses_state: True when the router reads ``hidden_state`` (the engine then captures it at
            prefill); False for fixed weights (no capture, ``hidden_state`` is None).
    """

    uses_state: bool

    def __call__(self, client: str, hidden_state: torch.Tensor | None) -> tuple[Mapping[str, float], Mapping[str, Any]]:
        """Return weights keyed by adapter pool name, and info reported in the response."""
        ...


@dataclass(frozen=True)
class FixedWeightRouter:
    """The fallback: a fixed local weight ``alpha`` for every request (FedDPA's ``inference_weight``)."""

    alpha: float
    uses_state: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def __call__(self, client: str, hidden_state: torch.Tensor | None) -> tuple[Mapping[str, float], Mapping[str, Any]]:
        weights = {GLOBAL: 1.0 - self.alpha, f"{client}{LOCAL_SUFFIX}": self.alpha}
        return weights, {"alpha": self.alpha, "source": "fixed"}


@dataclass(frozen=True)
class TargetPlan:
    """How to serve one request.

    Attributes:
        mode: ``base``, ``adapter``, ``feddpa`` or ``mixture``.
        names: adapter pool names (K).
        weights: (K,) decode weights (for ``feddpa`` with a state router: replaced by ``weight_fn``).
        prefill_weights: (K,) prefill weights when ``weight_fn`` is set.
        weight_fn: the routing hook given to the engine, or None.
    """

    mode: str
    names: tuple[str, ...]
    weights: tuple[float, ...]
    prefill_weights: tuple[float, ...] | None = None
    weight_fn: WeightFn | None = None
    info: Mapping[str, Any] | None = None


class TargetResolver:
    """Maps model names to :class:`TargetPlan` objects over the pool's current adapters.

    Args:
        base_name: the name the base model is served under.
        pool: the adapter pool (None: base model only).
        router: the FedDPA weight router; None uses ``FixedWeightRouter(default_alpha)``.
        default_alpha: the fixed local weight without a router (the run's ``inference_weight``).
    """

    def __init__(self, base_name: str, pool: AdapterPool | None, router: WeightRouter | None = None,
                 default_alpha: float = 0.5) -> None:
        self.base_name = base_name
        self.pool = pool
        self.router: WeightRouter = router if router is not None else FixedWeightRouter(default_alpha)

    def clients(self) -> list[str]:
        """Clients with a local adapter loaded next to ``global``."""
        if self.pool is None or GLOBAL not in self.pool:
            return []
        return [n[: -len(LOCAL_SUFFIX)] for n in self.pool.names() if n.endswith(LOCAL_SUFFIX)]

    def models(self) -> list[str]:
        """Every name ``resolve`` accepts: base, loaded adapters, FedDPA clients."""
        adapters = self.pool.names() if self.pool is not None else []
        return [self.base_name, *adapters, *(c for c in self.clients() if c not in adapters)]

    def resolve(self, model: str, mixture: Sequence[tuple[str, float]] | None = None) -> TargetPlan:
        """Return the plan for ``model`` (or the explicit ``mixture``).

        Raises:
            ModelNotFound: ``model`` or a mixture adapter names nothing served here.
            InvalidRequest: the mixture repeats an adapter.
        """
        known = self.models()
        if model not in known:
            raise ModelNotFound(f"the model {model!r} does not exist; available: {known}")
        if mixture:
            names = tuple(n for n, _ in mixture)
            if len(set(names)) != len(names):
                raise InvalidRequest("adapters in the mixture must be unique", param="adapters")
            missing = [n for n in names if self.pool is None or n not in self.pool]
            if missing:
                raise ModelNotFound(f"adapters {missing} are not loaded")
            return TargetPlan("mixture", names, tuple(float(w) for _, w in mixture))
        if model == self.base_name:
            return TargetPlan("base", (), ())
        if self.pool is not None and model in self.pool:
            return TargetPlan("adapter", (model,), (1.0,))
        return self._feddpa(model)

    def _feddpa(self, client: str) -> TargetPlan:
        names = (GLOBAL, f"{client}{LOCAL_SUFFIX}")
        router = self.router
        if not router.uses_state:
            weights, info = router(client, None)
            return TargetPlan("feddpa", names, tuple(float(weights.get(n, 0.0)) for n in names), info=dict(info))

        def route(state: torch.Tensor) -> tuple[tuple[float, ...], Mapping[str, Any]]:
            weights, info = router(client, state)
            return tuple(float(weights.get(n, 0.0)) for n in names), info

        return TargetPlan("feddpa", names, (1.0, 0.0), prefill_weights=(1.0, 0.0), weight_fn=route)
