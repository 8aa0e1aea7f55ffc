"""Remembered routing states: a prompt routed once is not prefilled again to be routed again.

A FedDPA request's routing pass (paper 000 section 4.3) prefills the prompt with the global adapter
alone and hands its final-layer state to the client's ``weight_fn``. That state depends only on the
prompt's tokens and the routing pass's adapter weights, not on the client, so the same prompt sent for
several clients (test-time personalization scores every client on every task's prompts; a user asking
several personas) needs the pass once. :class:`RouteStates` keeps the most recent states, keyed like the
prefix cache (adapter names, weights and the identity of their tensors, so a replaced adapter never
matches) plus the tenant, the pooling and the prompt's ids. A state taken from here differs from a fresh
pass's by float rounding only (another batch), as a reused prefix does; the seeded random instance draw
keys on the prompt's ids, not on the state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch


class RouteStates:
    """A bounded LRU map from (pass key, tenant, pooling, prompt ids) to a routing state (on the CPU).

    Args:
        capacity: states kept (0: off). A state is one hidden vector (576 floats for SmolLM2, 4,096 for
            a 7B model), so the default 4,096 costs 9 MiB to 64 MiB.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"RouteStates capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._states: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._states)

    @staticmethod
    def _key(pass_key: Hashable | None, scope: str, pooling: str, ids: Sequence[int]) -> Hashable | None:
        return None if pass_key is None else (pass_key, scope, pooling, tuple(ids))

    def get(self, pass_key: Hashable | None, scope: str, pooling: str, ids: Sequence[int]) -> torch.Tensor | None:
        """The remembered state of this routing pass, or None (``pass_key`` None: never remembered)."""
        key = self._key(pass_key, scope, pooling, ids)
        if key is None or key not in self._states:
            return None
        self._states.move_to_end(key)
        self.hits += 1
        return self._states[key]

    def put(self, pass_key: Hashable | None, scope: str, pooling: str, ids: Sequence[int], state: torch.Tensor) -> None:
        """Remember ``state`` (a CPU copy), evicting the least recently used beyond ``capacity``."""
        key = self._key(pass_key, scope, pooling, ids)
        if key is None or self.capacity == 0:
            return
        self._states[key] = state.detach().to("cpu", copy=True)
        self._states.move_to_end(key)
        while len(self._states) > self.capacity:
            self._states.popitem(last=False)

    def clear(self) -> None:
        """Forget every state (the engine's adapters were replaced wholesale)."""
        self._states.clear()
