"""The running batch's KV cache: one left-padded tensor pair per layer, rows added and removed by index.

Continuous batching needs rows of different lengths in one cache. Each request is prefilled alone
(its own cache, no padding, so its prefill equals a solo run), then its per-layer K/V are merged into
the batch cache: both sides are left-padded to the longer length and an attention mask (B, L) marks
the real slots. Finished rows are dropped by index, and leading columns that became padding in every
row are trimmed so the cache never grows past the longest live sequence. Position ids are per row:
the count of real tokens so far, so a row's positions are exactly those of a solo run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

# One (K, V) pair per decoder layer, each (B, H_kv, L, D).
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def cache_to_layers(cache: DynamicCache) -> LayerKV:
    """Return the (K, V) tensors of every layer of an HF :class:`DynamicCache`."""
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[attr-defined]


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class BatchKV:
    """KV cache of the running batch (rows in the order of the engine's row list)."""

    def __init__(self) -> None:
        self.layers: LayerKV = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # (B, L): 1 on real slots

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def add(self, layers: LayerKV) -> None:
        """Append one or more rows whose caches have no padding (a solo prefill), as the last rows."""
        new_len = int(layers[0][0].shape[2])
        new_rows = int(layers[0][0].shape[0])
        new_mask = torch.ones(new_rows, new_len, dtype=torch.long)
        if self.rows == 0:
            self.layers, self.mask = [(k, v) for k, v in layers], new_mask
            return
        length = max(self.length, new_len)
        merged: LayerKV = []
        for (k_old, v_old), (k_new, v_new) in zip(self.layers, layers, strict=True):
            k = torch.cat([_left_pad(k_old, length, 2), _left_pad(k_new.to(k_old.dtype), length, 2)])
            v = torch.cat([_left_pad(v_old, length, 2), _left_pad(v_new.to(v_old.dtype), length, 2)])
            merged.append((k, v))
        self.layers = merged
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(new_mask, length, 1)])

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order) and trim columns that are padding in every kept row."""
        if not rows:
            self.layers, self.mask = [], torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(list(rows), dtype=torch.long)
        mask = self.mask.index_select(0, index)
        real = mask.any(dim=0).nonzero()
        start = int(real[0]) if real.numel() else 0
        self.mask = mask[:, start:]
        self.layers = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                       for k, v in self.layers]

    def next_positions(self) -> torch.Tensor:
        """(B, 1) position id of each row's next token (its real length so far)."""
        return self.mask.sum(dim=1, keepdim=True)

    def step_mask(self) -> torch.Tensor:
        """(B, L + 1) attention mask of a decode step (every row adds one real token)."""
        return torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.long)], dim=1)

    def as_hf_cache(self) -> DynamicCache:
        """Wrap the tensors in an HF cache for one forward (HF appends the new step's K/V to it)."""
        cache = DynamicCache()
        for i, (k, v) in enumerate(self.layers):
            cache.update(k, v, i)
        return cache

    def after_step(self, cache: DynamicCache) -> None:
        """Take the cache back after a decode step: every row gained one real slot."""
        self.layers = cache_to_layers(cache)
        self.mask = self.step_mask()
