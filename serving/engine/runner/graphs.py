"""CUDA graphs of the fused decode step, one per (batch bucket, adapter-slot bucket).

A decode step launches a few hundred small kernels; replaying them as one captured CUDA graph
removes the launch cost that otherwise dominates small batches (vLLM and gpt-fast do the same).
Inputs are copied into static buffers (token ids, positions, slots, per-row adapter weights), the
batch is padded up to its bucket with rows that write only into the scratch slot, and the graph's
logits are read back for the real rows. Graphs share one memory pool and are captured lazily, the
first time a bucket is used; they stay valid while the KV slots and the adapter stacks keep their
addresses (both are allocated once on CUDA).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from serving.engine.runner.inputs import DecodeRow, StepOutput
from serving.engine.runner.llama import LlamaRunner

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch`` (vLLM's capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def slot_bucket(used: int, capacity: int) -> int:
    """The adapter-slot bucket covering ``used`` slots: 0, then powers of two up to ``capacity``."""
    if used <= 0:
        return 0
    bucket = 1
    while bucket < used:
        bucket *= 2
    return min(bucket, capacity)


class DecodeGraphs:
    """Captured decode steps of a :class:`LlamaRunner` on CUDA.

    Args:
        runner: the fused runner (its KV slots and adapter stacks must not move).
        max_batch: the engine's largest batch.
    """

    def __init__(self, runner: LlamaRunner, max_batch: int) -> None:
        if runner.kv.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.runner = runner
        self.buckets = batch_buckets(max_batch)
        dev = runner.kv.device
        top = self.buckets[-1]
        self.ints = torch.zeros(3, top, dtype=torch.long, device=dev)  # ids, positions, slots
        self.host = torch.zeros(3, top, dtype=torch.long).pin_memory()
        slots = runner.slots
        self.wexp: dict[str, torch.Tensor] = {}
        if slots is not None:
            for group, lay in slots.layouts.items():
                width = slots.capacity * len(lay.targets) * slots.rank
                self.wexp[group] = torch.zeros(top, width, dtype=runner.kv.dtype, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, rows: int) -> int | None:
        """The captured batch size for ``rows``, or None when larger than every bucket."""
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def _inputs(self, batch: int, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         dict[str, torch.Tensor]]:
        slots = self.runner.slots
        lora = {}
        if active and slots is not None:
            for group, lay in slots.layouts.items():
                lora[group] = self.wexp[group][:batch, : active * len(lay.targets) * slots.rank]
        return self.ints[0, :batch], self.ints[1, :batch], self.ints[2, :batch], lora

    def _capture(self, batch: int, active: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos, slots, lora = self._inputs(batch, active)
        ids.zero_()
        pos.zero_()
        slots.fill_(self.runner.kv.scratch)  # warm-up and capture write only the scratch slot
        for tensor in lora.values():
            tensor.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self.runner.autocast():
            for _ in range(2):  # compiles the Triton kernels and warms cuBLAS outside the capture
                self.runner.decode_tensors(ids, pos, slots, lora)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), self.runner.autocast():
            logits = self.runner.decode_tensors(ids, pos, slots, lora)
        logger.info("captured a CUDA graph for %d rows and %d adapter slots", batch, active)
        return graph, logits

    def decode(self, rows: Sequence[DecodeRow]) -> StepOutput | None:
        """Replay the graph for ``rows`` (None when no bucket fits: run eagerly instead)."""
        batch = self.bucket(len(rows))
        if batch is None:
            return None
        runner = self.runner
        w = runner.slot_weights([r.adapters for r in rows],
                                lambda n: slot_bucket(n, runner.slots.capacity if runner.slots else 0))
        active = 0 if w is None else int(w.shape[1])
        key = (batch, active)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, active)
        graph, logits = self.graphs[key]
        n = len(rows)
        host = self.host[:, :batch]
        host[0, :n] = torch.tensor([r.token for r in rows])
        host[1, :n] = torch.tensor([r.position for r in rows])
        host[2, :n] = torch.tensor([r.slot for r in rows])
        host[0, n:], host[1, n:], host[2, n:] = 0, 0, runner.kv.scratch
        self.ints[:, :batch].copy_(host, non_blocking=True)
        _, _, _, lora = self._inputs(batch, active)
        if w is not None:
            assert runner.slots is not None  # slot_weights gives weights only with adapter slots
            padded = torch.zeros(batch, active)
            padded[:n] = w
            for group, tensor in lora.items():
                tensor.copy_(runner.slots.expand(padded, group).to(tensor.dtype), non_blocking=True)
        graph.replay()
        return StepOutput(logits=logits[:n])
