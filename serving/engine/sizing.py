"""Engine defaults sized to the machine: KV slots and context from the memory the device has free.

As vLLM sizes its KV cache from a fraction of the GPU's memory (``gpu_memory_utilization``), a server
left at its defaults holds as many request slots as that fraction of the free memory allows at the
chosen context: on CUDA the memory free once the model is loaded, on a CPU the RAM the kernel reports
available, with a smaller fraction (the machine also runs everything else) and a cap on slots (a CPU
decode step's time grows with its rows; a laptop must stay usable). The context is the model's own,
capped, and shortened only when not even ``min_slots`` slots would fit. Pure arithmetic here
(:func:`plan_slots`); :func:`free_bytes` reads the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from serving.engine.lifecycle import EngineConfig

CUDA_FRACTION = 0.8  # of the memory free after the model loaded: the rest is activations and CUDA graphs
CPU_FRACTION = 0.25  # of the RAM available: the machine runs other programs too
CUDA_MAX_SLOTS = 256  # vLLM's default max_num_seqs
CPU_MAX_SLOTS = 64
CONTEXT_CAP = 8192  # a model's context beyond this is not held by default (--max-model-len asks for it)
MIN_CONTEXT = 256


@dataclass(frozen=True)
class SlotPlan:
    """What a default engine holds and why.

    Attributes:
        slots: KV slots (requests decoded at once).
        max_model_len: positions per slot (prompt plus completion).
        kv_bytes: the cache at full length (``slots`` plus the extra rows) in bytes.
        budget_bytes: the memory the plan was allowed (free memory x fraction).
        source: where the free memory was read (``cuda:0 free``, ``cpu MemAvailable``).
    """

    slots: int
    max_model_len: int
    kv_bytes: int
    budget_bytes: int
    source: str

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"KV cache sized to the machine: {self.slots} slots x {self.max_model_len} positions "
                f"({self.kv_bytes / 2**30:.2f} GiB of a {self.budget_bytes / 2**30:.2f} GiB budget from "
                f"{self.source}); --max-batch-size / --max-model-len override")


def kv_bytes_per_position(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one position of one slot takes in the K and V caches of every layer."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def plan_slots(budget_bytes: int, per_position: int, context: int, extra_rows: int, max_slots: int,
               min_slots: int = 4, source: str = "") -> SlotPlan:
    """The slots and context that fit ``budget_bytes``.

    Args:
        budget_bytes: memory the cache may take.
        per_position: :func:`kv_bytes_per_position`.
        context: the wanted context (the model's, capped).
        extra_rows: cache rows beside the slots (the scratch slot and the prefix cache's spares).
        max_slots: the most slots wanted.
        min_slots: fewer fit at ``context``: the context halves (not below ``MIN_CONTEXT``) until they do.
        source: where the budget came from (for :meth:`SlotPlan.describe`).

    Returns:
        At least one slot, at most ``max_slots``; a context of at least ``min(context, MIN_CONTEXT)``.
    """
    if per_position < 1 or context < 1 or max_slots < 1 or extra_rows < 0:
        raise ValueError(f"per_position, context and max_slots must be >= 1 and extra_rows >= 0, got "
                         f"{per_position}, {context}, {max_slots}, {extra_rows}")
    budget = max(int(budget_bytes), 0)
    length = context
    floor = min(context, MIN_CONTEXT)
    while True:
        rows = budget // (per_position * length)
        slots = min(max(rows - extra_rows, 1), max_slots)
        if slots >= min(min_slots, max_slots) or length <= floor:
            break
        length = max(length // 2, floor)
    return SlotPlan(slots, length, (slots + extra_rows) * per_position * length, budget, source)


def free_bytes(device: torch.device) -> tuple[int, str]:
    """Memory free for the KV cache on ``device`` and where it was read (CUDA: free device memory; CPU:
    ``MemAvailable`` of /proc/meminfo, else the free physical pages)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"{device} free memory"
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "cpu MemAvailable"
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "cpu free pages"


def machine_plan(device: torch.device, per_position: int, model_context: int | None, extra_rows: int,
                 max_model_len: int | None = None) -> SlotPlan:
    """:func:`plan_slots` for ``device`` with its fraction and cap (``max_model_len`` given: kept as it is)."""
    free, source = free_bytes(device)
    cuda = device.type == "cuda"
    fraction = CUDA_FRACTION if cuda else CPU_FRACTION
    context = max_model_len or min(model_context or 2048, CONTEXT_CAP)
    plan = plan_slots(int(free * fraction), per_position, context, extra_rows,
                      CUDA_MAX_SLOTS if cuda else CPU_MAX_SLOTS, min_slots=1 if max_model_len else 4,
                      source=f"{fraction:g} x {source}")
    return plan


def sized_config(config: EngineConfig, model_config: PreTrainedConfig, dtype: torch.dtype, device: torch.device
                 ) -> tuple[EngineConfig, SlotPlan | None]:
    """``config`` with its ``auto_slots`` / ``auto_context`` fields resolved for this model and device.

    Returns:
        The config to build the engine with, and the plan (None when nothing was automatic).
    """
    if not (config.auto_slots or config.auto_context):
        return config, None
    mc = model_config
    heads = int(mc.num_attention_heads)
    head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // heads)
    kv_heads = int(getattr(mc, "num_key_value_heads", None) or heads)
    per_position = kv_bytes_per_position(int(mc.num_hidden_layers), kv_heads, head_dim, dtype)
    context = getattr(mc, "max_position_embeddings", None)
    plan = machine_plan(device, per_position, context if isinstance(context, int) else None,
                        1 + config.prefix_cache_slots, None if config.auto_context else config.max_model_len)
    if not config.auto_slots:  # the slots were given: only the context follows the model
        plan = SlotPlan(config.max_batch_size, plan.max_model_len,
                        (config.max_batch_size + 1 + config.prefix_cache_slots) * per_position * plan.max_model_len,
                        plan.budget_bytes, plan.source)
    return replace(config, max_batch_size=plan.slots, max_model_len=plan.max_model_len), plan
