"""What a federated run's tensors and seeds are, below every other training module: the state dicts that travel,
a client's private state, their size on the wire, and the seed every random choice derives from.

A leaf (torch and the standard library only), so the contract (:mod:`training.protocol`), the local trainer
and the round loop all name these without importing one another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

StateDict = dict[str, torch.Tensor]
# A client's private state: named adapters (``"local"`` ...) that never leave it. The runtime persists
# it between rounds (simulator: memory plus ``rounds/<r>/clients/<id>/``; Flower: ``Context.state``).
ClientState = dict[str, StateDict]


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes on the wire for a state dict (tensor payload only)."""
    return int(sum(t.numel() * t.element_size() for t in state.values()))


def derive_seed(seed: int, *parts: object) -> int:
    """A stable 31-bit seed from the run seed and any labels (round, client, phase).

    Every random choice of a run is derived this way, never from a shared generator's position, so a
    resumed run (or a client run on another machine) draws exactly what the uninterrupted run drew.
    """
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
