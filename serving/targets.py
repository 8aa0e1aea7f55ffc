"""Serving targets: turn a request's ``model`` name (or explicit mixture) into adapters and weights.

Names a request can use (the OpenAI ``model`` field):

* the base model's name: no adapter;
* ``global``, ``<client>:local`` or any adapter loaded at run time: that adapter alone at weight 1;
* ``<client>``: FedDPA's personalised model (paper 000 section 4.3), weights ``(1 - a, a)`` over
  (``global``, ``<client>:local``). With a :class:`WeightRouter` that reads the prompt, ``a`` is
  instance-wise: the engine prefills with the global adapter alone, hands the router the final-layer
  last-token state, and decodes with the router's weights. Without one, ``a`` is the run's
  ``inference_weight`` (:class:`FixedWeightRouter`);
* ``<client>`` of a FedAMoLE run (paper 002 section 4.2): every token routed over that client's
  experts inside the layers (:mod:`serving.engine.amole`); the plan names the client once at weight 1
  and the pool's lease turns it into the route the engine reads (the client's own model where the run
  has one, the aggregated pool then serving ``amole:<client>``: :mod:`serving.pool.amole_run`). An AMoLE
  run has no global adapter, so ``global`` exists only where a run or the operator loaded one;
* an explicit mixture ``[(name, weight), ...]`` (the HTTP ``adapters`` extension field) overrides all;
  it mixes plain adapters only (AMoLE clients weight their experts per token themselves).

The router protocol is ``routing``'s :class:`~routing.base.WeightRouter` (the one contract): any
callable ``(client, hidden_state, prompt_ids) -> RoutingDecision`` over served adapter names that
declares ``uses_state`` and ``pooling`` plugs in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from routing.base import GLOBAL, LOCAL_SUFFIX, Pooling, RoutingDecision, WeightRouter, local_name
from routing.static import FixedWeightRouter
from serving.engine.request import WeightFn
from serving.errors import InvalidRequest, ModelNotFound
from serving.pool import AdapterPool


@dataclass(frozen=True)
class TargetPlan:
    """How to serve one request.

    Serve it by leasing ``names`` from the pool and submitting the lease's names with ``weights``,
    ``prefill_weights`` and ``weight_fn``; that holds for every mode, AMoLE included.

    Attributes:
        mode: ``base``, ``adapter``, ``feddpa``, ``amole`` or ``mixture``.
        names: adapter pool names (K); for ``amole`` the client's name (K = 1).
        weights: (K,) decode weights (for ``feddpa`` with a state router: replaced by ``weight_fn``).
        prefill_weights: (K,) prefill weights when ``weight_fn`` is set.
        weight_fn: the routing hook given to the engine, or None.
        info: routing facts for the response (the engine's, when it routes, replace them).
        client: the personalised client served (``feddpa`` and ``amole``), else None.
        pooling: the prompt state ``weight_fn`` reads: the last token's (``last``) or the mean over the
            prompt's tokens (``mean``): the router's ``pooling``.
    """

    mode: str
    names: tuple[str, ...]
    weights: tuple[float, ...]
    prefill_weights: tuple[float, ...] | None = None
    weight_fn: WeightFn | None = None
    info: Mapping[str, Any] | None = None
    client: str | None = None
    pooling: Pooling = "last"


class TargetResolver:
    """Maps model names to :class:`TargetPlan` objects over the pool's current adapters.

    Args:
        base_name: the name the base model is served under.
        pool: the adapter pool (None: base model only).
        router: the FedDPA weight router; None uses ``FixedWeightRouter(default_alpha)``.
        default_alpha: the fixed local weight without a router (the run's ``inference_weight``).
        aliases: more names of the base model (vLLM's ``--served-model-name NAME ALIAS...``).
    """

    def __init__(self, base_name: str, pool: AdapterPool | None, router: WeightRouter | None = None,
                 default_alpha: float = 0.5, aliases: Sequence[str] = ()) -> None:
        self.base_name = base_name
        self.aliases = tuple(dict.fromkeys(a for a in aliases if a != base_name))
        self.pool = pool
        self.router: WeightRouter = router if router is not None else FixedWeightRouter(default_alpha)

    def clients(self) -> list[str]:
        """Personalised clients: FedDPA ones (a local adapter next to ``global``), then AMoLE ones."""
        if self.pool is None:
            return []
        feddpa = ([n[: -len(LOCAL_SUFFIX)] for n in self.pool.names() if n.endswith(LOCAL_SUFFIX)]
                  if GLOBAL in self.pool else [])
        seen = set(feddpa)
        return [*feddpa, *(c for c in self.pool.amole_clients() if c not in seen)]

    def models(self) -> list[str]:
        """Every name ``resolve`` accepts: base, loaded adapters, FedDPA and AMoLE clients."""
        adapters = self.pool.names() if self.pool is not None else []
        seen = set(adapters)  # a set: a run with 1,000 clients made this list check quadratic
        return [self.base_name, *self.aliases, *adapters, *(c for c in self.clients() if c not in seen)]

    def serves(self, model: str) -> bool:
        """True when ``resolve`` accepts ``model``: the same names as :meth:`models`, in constant time.

        ``resolve`` runs for every request; building the full list there cost about 11 ms per request
        with 1,000 clients (``bench/serving/scale.py``).
        """
        if model == self.base_name or model in self.aliases:
            return True
        if self.pool is None:
            return False
        if model in self.pool or self.pool.amole_model_of(model) is not None:
            return True
        return GLOBAL in self.pool and f"{model}{LOCAL_SUFFIX}" in self.pool

    def describe(self, model: str) -> dict[str, Any]:
        """What ``model`` is, for ``/v1/models`` cards (``kind`` and the parts it uses)."""
        if model == self.base_name:
            return {"kind": "base"}
        if model in self.aliases:
            return {"kind": "base", "alias_of": self.base_name}
        if self.pool is not None and model in self.pool:
            return {"kind": "adapter"}
        owner = self.pool.amole_model_of(model) if self.pool is not None else None
        if self.pool is not None and owner is not None:
            info = self.pool.info(owner)[0]
            return {"kind": "amole", "model": owner, "version": info.version, "loaded": info.loaded}
        return {"kind": "feddpa", "adapters": [GLOBAL, f"{model}{LOCAL_SUFFIX}"]}

    def resolve(self, model: str, mixture: Sequence[tuple[str, float]] | None = None) -> TargetPlan:
        """Return the plan for ``model`` (or the explicit ``mixture``).

        Raises:
            ModelNotFound: ``model`` or a mixture adapter names nothing served here.
            InvalidRequest: the mixture repeats an adapter.
        """
        if not self.serves(model):
            raise ModelNotFound(f"the model {model!r} does not exist (GET /v1/models lists what this key may use)")
        if mixture:
            names = tuple(n for n, _ in mixture)
            if len(set(names)) != len(names):
                raise InvalidRequest("adapters in the mixture must be unique", param="adapters")
            routed = [n for n in names if self.pool is not None and self.pool.amole_model_of(n) is not None]
            if routed:
                raise InvalidRequest(f"{routed} are AMoLE clients, routed per token; a weighted mixture takes "
                                     "plain adapters only", param="adapters")
            missing = [n for n in names if self.pool is None or n not in self.pool]
            if missing:
                raise ModelNotFound(f"adapters {missing} are not loaded")
            return TargetPlan("mixture", names, tuple(float(w) for _, w in mixture))
        if model == self.base_name or model in self.aliases:
            return TargetPlan("base", (), ())
        if self.pool is not None and model in self.pool:
            return TargetPlan("adapter", (model,), (1.0,))
        owner = self.pool.amole_model_of(model) if self.pool is not None else None
        if owner is not None:
            return TargetPlan("amole", (model,), (1.0,), info={"client": model, "model": owner}, client=model)
        return self._feddpa(model)

    def _feddpa(self, client: str) -> TargetPlan:
        names = (GLOBAL, local_name(client))
        router = self.router
        if not router.uses_state:
            decision = router(client, None)
            return TargetPlan("feddpa", names, _weights_for(names, decision), info=dict(decision.info), client=client)

        def route(state: torch.Tensor, ids: Sequence[int]) -> tuple[tuple[float, ...], Mapping[str, Any]]:
            decision = router(client, state, ids)
            return _weights_for(names, decision), decision.info

        return TargetPlan("feddpa", names, (1.0, 0.0), prefill_weights=(1.0, 0.0), weight_fn=route, client=client,
                          pooling=router.pooling)


def _weights_for(names: Sequence[str], decision: RoutingDecision) -> tuple[float, ...]:
    """The decision's weights in the order of ``names`` (0 for a name it does not give)."""
    given = dict(zip(decision.names, decision.weights.tolist(), strict=True))
    return tuple(float(given.get(n, 0.0)) for n in names)


__all__ = ["GLOBAL", "LOCAL_SUFFIX", "FixedWeightRouter", "TargetPlan", "TargetResolver", "WeightRouter"]
