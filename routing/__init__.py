"""Routing: turns a request (or a token) into adapter weights over named adapters.

FedDPA instance-wise weighting (paper 000 section 4.3) over cached per-client embeddings, static and
explicit weights, and the one contract: every router returns a ``RoutingDecision``, and serving asks a
``WeightRouter`` for a client's. Imports only ``adapters`` (plus torch, numpy, faiss).
"""

from routing.base import (
    GLOBAL,
    LOCAL_SUFFIX,
    RoutingDecision,
    RoutingError,
    StoredRoutingError,
    WeightRouter,
    local_name,
)
from routing.cache import EmbeddingIndex, IndexCache
from routing.embedding import embed_prompts, last_token_state
from routing.feddpa import FedDPARouter
from routing.static import FixedWeightRouter, base_model, fixed_feddpa, mixture, single

__all__ = [
    "GLOBAL",
    "LOCAL_SUFFIX",
    "EmbeddingIndex",
    "FedDPARouter",
    "FixedWeightRouter",
    "IndexCache",
    "RoutingDecision",
    "RoutingError",
    "StoredRoutingError",
    "WeightRouter",
    "base_model",
    "embed_prompts",
    "fixed_feddpa",
    "last_token_state",
    "local_name",
    "mixture",
    "single",
]
