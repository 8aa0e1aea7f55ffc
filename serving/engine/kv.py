"""The engine's KV cache: preallocated slots per layer, written in place, one slot per sequence.

Every running or prefilling request owns one slot; its keys and values for positions ``0..n-1`` live
at ``k[layer][slot, :, :n]`` (vLLM's idea of a cache managed apart from the model, without its
paging: a slot is a contiguous row, so a decode step never copies the cache, it only writes each
row's new position). The last slot is scratch: padded batch rows and padding tokens write there, so
a padded batch (a CUDA graph bucket, the HF runner's left-padded prefill) never touches a real sequence.
Spare slots after it hold recent prompts for :mod:`serving.engine.prefix_cache`; no row ever reads them.
A released slot's keys and values are zeroed where its owner wrote, so every stale cell a batch reads
at weight 0 is finite (the attention then needs no masked copy of the cache).

On CUDA the buffers are allocated at full length once (their addresses must stay fixed for captured
CUDA graphs); on the CPU they start short and double on demand up to ``max_len``, so a server with a
2048-token limit does not hold 2048 positions per slot until a request needs them.
"""

from __future__ import annotations

import torch

from serving.errors import InvalidRequest


class SlotKV:
    """Per-layer K and V buffers ``(slots + 1 + spare, kv_heads, capacity, head_dim)`` and slot bookkeeping.

    Args:
        num_layers: decoder layers.
        num_slots: sequences held at once (the scratch slot comes on top).
        kv_heads: key/value heads per layer.
        head_dim: dimension of one head.
        max_len: positions a slot may hold at most (prompt plus completion).
        dtype: the cache dtype (the activations' dtype).
        device: where the buffers live (the model's device).
        grow: start small and double the capacity on demand (False: allocate ``max_len`` now).
        spare: slots after the scratch slot for the prefix cache (never owned by a sequence).
    """

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, grow: bool | None = None, spare: int = 0) -> None:
        if num_slots < 1 or max_len < 1 or spare < 0:
            raise ValueError(f"num_slots and max_len must be >= 1 and spare >= 0, got {num_slots}, {max_len} "
                             f"and {spare}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.num_slots = num_slots
        self.scratch = num_slots  # index of the scratch slot
        self.spare_slots = tuple(range(num_slots + 1, num_slots + 1 + spare))
        self.max_len = max_len
        self.dtype, self.device = dtype, torch.device(device)
        self.grow = self.device.type == "cpu" if grow is None else grow
        capacity = min(max_len, 256) if self.grow else max_len
        try:
            self.k = [self._buffer(capacity) for _ in range(num_layers)]
            self.v = [self._buffer(capacity) for _ in range(num_layers)]
        except torch.OutOfMemoryError as exc:
            gib = self.bytes_for(max_len) / 2**30
            raise RuntimeError(f"the KV cache ({num_slots} slots x {max_len} positions, {gib:.1f} GiB) does not "
                               "fit on the device; lower --max-batch-size or --max-model-len") from exc
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first

    def _buffer(self, capacity: int) -> torch.Tensor:
        shape = (self.num_slots + 1 + len(self.spare_slots), self.kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def bytes_for(self, length: int) -> int:
        """Bytes the K and V buffers take at ``length`` positions per slot."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        rows = self.num_slots + 1 + len(self.spare_slots)
        return 2 * self.num_layers * rows * self.kv_heads * length * self.head_dim * itemsize

    @property
    def capacity(self) -> int:
        """Positions every slot can hold now."""
        return int(self.k[0].shape[2])

    @property
    def free_slots(self) -> int:
        """Slots not owned by a sequence."""
        return len(self._free)

    def allocate(self) -> int | None:
        """Take a free slot (the lowest), or None when every slot is owned."""
        return self._free.pop() if self._free else None

    def release(self, slot: int, written: int | None = None) -> None:
        """Give a slot back, its key and value cells zeroed over the positions its owner may have written.

        The attention reads a batch's rows up to the longest one and weights each row's positions past
        its own length by an exact 0, which leaves the result unchanged only while the stale cells are
        finite (SDPA adds the mask to the scores, so a NaN key stays NaN; 0 x NaN is NaN): an owner whose
        adapter produced NaN must not poison the next owner, so every cell past a row's length holds a
        finite value (zeros, or an earlier finite owner's).

        Args:
            slot: the slot to free.
            written: positions ``0 .. written - 1`` its owner may have written (None: all of them).
        """
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not owned")
        end = self.capacity if written is None else min(max(int(written), 0), self.capacity)
        for k, v in zip(self.k, self.v, strict=True):
            k[slot, :, :end].zero_()
            v[slot, :, :end].zero_()
        self._free.append(slot)
        self._free.sort(reverse=True)

    def reset(self) -> None:
        """Forget every owner (after an engine failure) and zero the keys and values; buffers are kept."""
        for k, v in zip(self.k, self.v, strict=True):
            k.zero_()
            v.zero_()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def ensure(self, length: int) -> None:
        """Make every slot hold at least ``length`` positions (doubling; only when ``grow``).

        Raises:
            InvalidRequest: ``length`` exceeds ``max_len``.
        """
        if length > self.max_len:
            raise InvalidRequest(f"{length} positions exceed the engine's max_model_len of {self.max_len}")
        if length <= self.capacity:
            return
        if not self.grow:  # allocated at max_len: unreachable unless max_len was exceeded
            raise InvalidRequest(f"{length} positions exceed the cache capacity {self.capacity}")
        new = self.capacity
        while new < length:
            new = min(2 * new, self.max_len)
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                fresh = self._buffer(new)
                fresh[:, :, : old.shape[2]] = old
                buffers[i] = fresh
