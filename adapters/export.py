"""Export a weighted mixture of LoRA adapters as one plain LoRA of the summed rank.

The identity (exact, no approximation):

    sum_k w_k s_k B_k A_k = [w_1 s_1 B_1, ..., w_K s_K B_K] [A_1; ...; A_K]

so a FedDPA client at a fixed ``a`` (weights ``(1 - a, a)`` over global and local) is one adapter of
rank ``r_g + r_l``. The per-adapter scalings are folded into B and the exported adapter uses
``lora_alpha = rank`` (scaling 1), which PEFT, vLLM and every LoRA runtime apply identically.

Adapters may target different modules and have different ranks: the export covers the union of their
modules, and where an adapter has no weights its block of ``A`` and ``B`` is zero (it adds nothing there,
as in serving). The exported ``target_modules`` is the adapters' common spec when they share one, else the
list of every adapted module's full path (PEFT matches a full path exactly).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from adapters.config import AdapterError, LoraConfig
from adapters.inject import AdaptedModel
from adapters.io import write_adapter_folder


def concat_adapters(
    adapted: AdaptedModel, mixture: Sequence[tuple[str, float]]
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """Return (config, tensors) of one adapter equal to ``sum_k w_k * adapter_k``.

    Args:
        adapted: the model holding the adapters.
        mixture: (adapter name, weight) pairs (targets and ranks may differ).

    Raises:
        AdapterError: empty mixture or unknown adapter.
    """
    if not mixture:
        raise AdapterError("a mixture to export needs at least one (adapter, weight) pair")
    for name, _ in mixture:
        if name not in adapted.configs:
            raise AdapterError(f"unknown adapter {name!r}; present: {adapted.adapter_names}")
    return concat_states([(adapted.configs[n], adapted.adapter_state(n), w) for n, w in mixture])


def concat_states(
    parts: Sequence[tuple[LoraConfig, Mapping[str, torch.Tensor], float]]
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """:func:`concat_adapters` on (config, ``{"<path>.lora_A": A, ...}``, weight) triples (files, no model).

    Raises:
        AdapterError: no parts, or an adapter's A and B disagree with another's on a module's widths.
    """
    if not parts:
        raise AdapterError("a mixture to export needs at least one (adapter, weight) pair")
    paths = list(dict.fromkeys(k[: -len(".lora_A")] for _, state, _ in parts for k in state if k.endswith(".lora_A")))
    specs = {config.target_modules for config, _, _ in parts}
    targets = specs.pop() if len(specs) == 1 else tuple(paths)
    rank = sum(config.r for config, _, _ in parts)
    out = LoraConfig(r=rank, alpha=float(rank), dropout=0.0, target_modules=targets)
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        held = [state for _, state, _ in parts if f"{path}.lora_A" in state]
        if any(f"{path}.lora_B" not in state for state in held):
            raise AdapterError(f"an adapter has lora_A but no lora_B for {path}")
        d, o = int(held[0][f"{path}.lora_A"].shape[1]), int(held[0][f"{path}.lora_B"].shape[0])
        if any(s[f"{path}.lora_A"].shape[1] != d or s[f"{path}.lora_B"].shape[0] != o for s in held):
            raise AdapterError(f"the adapters disagree on the widths of {path}: not adapters of one base model")
        A = torch.cat([state[f"{path}.lora_A"].float().cpu() if f"{path}.lora_A" in state else torch.zeros(c.r, d)
                       for c, state, _ in parts], dim=0)  # (r_sum, d); zero where an adapter has no weights
        B = torch.cat([w * c.scaling * state[f"{path}.lora_B"].float().cpu() if f"{path}.lora_B" in state
                       else torch.zeros(o, c.r) for c, state, w in parts], dim=1)  # (o, r_sum)
        tensors[f"{path}.lora_A"], tensors[f"{path}.lora_B"] = A, B
    return out, tensors


def export_mixture(adapted: AdaptedModel, mixture: Sequence[tuple[str, float]], folder: str | Path) -> Path:
    """Write ``sum_k w_k * adapter_k`` as a PEFT adapter folder of rank ``sum_k r_k``."""
    config, tensors = concat_adapters(adapted, mixture)
    return write_adapter_folder(folder, config, tensors, adapted.base_model_name)
