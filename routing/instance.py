"""FedDPA instance-wise weighting as a :class:`~routing.base.WeightRouter`: the prompt's state -> ``(1 - a, a)``.

Paper 000 section 4.3: the request's final-layer last-token state (captured by the engine during the
prefill it runs anyway, with the global adapter on) is compared with S of the client's cached
local-instance embeddings (``routing.cache``, a faiss index per client written at the end of
training); ``a = lambda * mean cosine``, clipped to [0, 1], weights ``<client>:local`` and ``1 - a``
the global adapter. The ``calibrated`` rule (``routing.calibration``) maps its own score (by default
the Mahalanobis distance to the client's instances) with the client's calibration stored beside its
index instead. Only the requested client's files are read.
The paper 000 ablations (Table 9's similarity, Table 10's mean-token embedding, the reference code's
assignment of ``a`` to the global adapter) are the router's options; with ``mean`` the engine hands over
the mean of the prompt's final-layer states (``pooling``) and every client's index must hold
mean-pooled vectors (:meth:`InstanceWeightRouter.check_run`).

In ``random`` mode with a seed, the S instances of a request are drawn from a generator seeded by
(seed, client, the prompt's token ids): still a uniform draw per request, but the same prompt draws
the same instances whatever order requests arrive in, whichever batch prefills it and whether its
prefix was reused from another prompt's pass, so a re-run or resumed evaluation reproduces its
weights. A caller that gives no ids keys the draw on the state's bytes instead. Without a seed every
request draws from fresh entropy.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from routing.base import Pooling, RoutingDecision
from routing.cache import IndexCache, check_index_pooling
from routing.feddpa import FedDPARouter
from routing.feddpa_options import FedDPAOptions


@dataclass
class InstanceWeightRouter:
    """A :class:`~routing.base.WeightRouter` backed by the FedDPA rule (:class:`FedDPARouter`) and the index cache.

    Attributes:
        router: the FedDPA decision rule (lambda, S, random or knn).
        cache: per-client embedding indexes of the served run.
        version: cache key part; bump it when the run is reloaded so no index is reused.
        version_of: the current version of a client's local adapter (the pool's); a reload changes it,
            so the client's index is read again with the adapter (None: ``version`` alone keys it).
    """

    router: FedDPARouter
    cache: IndexCache
    version: int = 0
    version_of: Callable[[str], int | None] | None = None
    uses_state: bool = field(default=True, init=False)

    @property
    def pooling(self) -> Pooling:
        """How the engine pools the prompt's final-layer states for this router: ``last`` or ``mean``."""
        return self.router.embedding

    @classmethod
    def for_run(cls, run_dir: Path, lambda_: float, options: FedDPAOptions = FedDPAOptions(), seed: int | None = 0,
                version: int = 0, version_of: Callable[[str], int | None] | None = None) -> InstanceWeightRouter:
        """Build from a run directory's ``adapters/clients/<id>/embeddings.*`` files.

        ``options`` (:class:`~routing.feddpa_options.FedDPAOptions`) give S, the sampling mode, the rule
        (``calibrated`` needs each client's ``embeddings.calibration.json``, else that client is weighted
        by the paper's rule), the similarity, the variant and the pooling.

        Raises:
            RoutingError: bad options, calibrated combined with an ablation of the paper's rule, or a
                client whose index was pooled otherwise than ``embedding`` (the message names the fix).
        """
        router = cls(options.router(lambda_, seed), IndexCache.for_run(run_dir), version, version_of)
        router.check_run(run_dir)
        return router

    def check_run(self, run_dir: Path) -> None:
        """Refuse, before any request, a run whose client indexes were pooled otherwise than the router's."""
        check_run_pooling(run_dir, self.router.embedding)

    def cache_key(self, client: str) -> str:
        """The index cache's version key of ``client``: the router's version and its adapter's."""
        adapter = self.version_of(client) if self.version_of is not None else None
        return f"{self.version}" if adapter is None else f"{self.version}.{adapter}"

    def __call__(self, client: str, hidden_state: torch.Tensor | None,
                 prompt_ids: Sequence[int] | None = None) -> RoutingDecision:
        """Weights of ``client``'s adapters for the prompt whose final-layer state is ``hidden_state`` (H,).

        ``prompt_ids`` (the prompt's token ids) key the seeded random draw; without them the state does.
        """
        if hidden_state is None:
            raise ValueError("instance-wise FedDPA weighting needs the prompt's hidden state")
        generator = None
        if self.router.mode == "random" and self.router.seed is not None:
            if prompt_ids is not None:
                key = np.asarray(list(prompt_ids), dtype=np.int64).tobytes()
            else:
                key = hidden_state.detach().float().cpu().contiguous().numpy().tobytes()
            generator = np.random.default_rng([self.router.seed, zlib.crc32(client.encode()), zlib.crc32(key)])
        decision = self.router.decide(hidden_state, self.cache.get(client, self.cache_key(client)), generator, client)
        return RoutingDecision(decision.names, decision.weights, {**dict(decision.info), "source": "instance"})


def check_run_pooling(run_dir: Path, embedding: str) -> None:
    """Refuse routing ``run_dir``'s clients with ``embedding`` pooling when an index was pooled otherwise.

    Raises:
        RoutingError: one line naming the clients and ``fedmosaic calibrate RUN --feddpa-embedding ...``.
    """
    root = IndexCache.for_run(run_dir).root
    folders = {p.name: p for p in sorted(root.iterdir()) if p.is_dir()} if root.is_dir() else {}
    check_index_pooling(folders, embedding, run_dir)
