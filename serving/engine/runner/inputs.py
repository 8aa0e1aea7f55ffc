"""What one engine step hands a model runner: the rows to prefill or decode, and what comes back.

A row is one sequence (one KV slot) with its adapter weights for this forward: names ``(K,)`` and
weights ``(K,)``, one row of the per-row weight matrix of the one contract (ARCHITECTURE.md), or an AMoLE route
(paper 002 section 4.2: per-token routing inside the layers); :func:`adapters.context.weight_matrix`
turns a batch of rows into the ``(B, K)`` matrix over the union of their adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RowAdapters:
    """A row's adapters: engine-internal names ``(K,)`` and their weights ``(K,)``; empty for the base."""

    names: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    amole: Any = None  # serving.engine.amole.AMoLEClientRoute: token-routed over the route's experts

    @property
    def plain(self) -> bool:
        """True unless the row is AMoLE-routed."""
        return self.amole is None


@dataclass(frozen=True)
class PrefillRow:
    """One sequence's prompt chunk: ``tokens`` at positions ``start .. start + len(tokens) - 1``.

    Attributes:
        slot: the sequence's KV slot.
        tokens: the chunk's token ids (at least one).
        start: position of ``tokens[0]`` (the slot already holds ``start`` positions).
        adapters: weights of this pass.
        want_state: return the final-layer state of the chunk's last token and the sum of the states over
            the chunk's tokens (FedDPA routing on the last token or the mean).
        all_logits: return the logits of every position of the chunk (prompt log-probabilities).
    """

    slot: int
    tokens: tuple[int, ...]
    start: int
    adapters: RowAdapters = RowAdapters()
    want_state: bool = False
    all_logits: bool = False

    @property
    def end(self) -> int:
        """Positions the slot holds after this chunk."""
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class DecodeRow:
    """One sequence's decode input: ``token`` at ``position`` (the slot holds ``position`` positions)."""

    slot: int
    token: int
    position: int
    adapters: RowAdapters = RowAdapters()


@dataclass
class StepOutput:
    """A forward's result per row.

    Attributes:
        logits: (B, V) next-token logits at each row's last token (float32 not required).
        states: (B, H) float32 final-layer states of the last tokens, when asked for.
        recorder: the AMoLE expert recorder of the forward, when AMoLE rows took part.
        all_logits: per row, (n, V) logits of every chunk position for rows that asked, else None.
        state_sums: (B, H) float32 sums of the final-layer states over each row's chunk tokens, with ``states``.
    """

    logits: torch.Tensor
    states: torch.Tensor | None = None
    recorder: Any = None
    all_logits: list[torch.Tensor | None] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    state_sums: torch.Tensor | None = None
