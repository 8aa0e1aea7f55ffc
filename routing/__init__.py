"""Routing: turns a request (or a token) into adapter weights over named adapters.

FedDPA instance-wise weighting (paper 000 section 4.3) over cached per-client embeddings, static and
explicit weights, and the contract every router returns (``RoutingDecision``). Imports only
``adapters`` (plus torch, numpy, faiss).
"""

from routing.base import (
    GLOBAL,
    LOCAL,
    Router,
    RoutingDecision,
    RoutingError,
    RoutingInput,
    stack_decisions,
)
from routing.cache import EmbeddingIndex, IndexCache
from routing.embedding import embed_prompts, last_token_state
from routing.feddpa import FedDPARouter
from routing.static import StaticRouter, base_model, fixed_feddpa, mixture, single

__all__ = [
    "GLOBAL",
    "LOCAL",
    "EmbeddingIndex",
    "FedDPARouter",
    "IndexCache",
    "Router",
    "RoutingDecision",
    "RoutingError",
    "RoutingInput",
    "StaticRouter",
    "base_model",
    "embed_prompts",
    "fixed_feddpa",
    "last_token_state",
    "mixture",
    "single",
    "stack_decisions",
]
