"""Export a weighted mixture of LoRA adapters as one plain LoRA of the summed rank.

The identity (exact, no approximation):

    sum_k w_k s_k B_k A_k = [w_1 s_1 B_1, ..., w_K s_K B_K] [A_1; ...; A_K]

so a FedDPA client at a fixed ``a`` (weights ``(1 - a, a)`` over global and local) is one adapter of
rank ``r_g + r_l``. The per-adapter scalings are folded into B and the exported adapter uses
``lora_alpha = rank`` (scaling 1), which PEFT, vLLM and every LoRA runtime apply identically.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        mixture: (adapter name, weight) pairs; all must target the same modules.

    Raises:
        AdapterError: empty mixture, unknown adapter, or adapters on different modules.
    """
    if not mixture:
        raise AdapterError("a mixture to export needs at least one (adapter, weight) pair")
    configs: list[LoraConfig] = []
    for name, _ in mixture:
        cfg = adapted.configs.get(name)
        if cfg is None:
            raise AdapterError(f"unknown adapter {name!r}; present: {adapted.adapter_names}")
        configs.append(cfg)
    targets = {tuple(sorted(c.target_modules)) for c in configs}
    if len(targets) != 1:
        raise AdapterError(f"adapters in one export must target the same modules, got {sorted(targets)}")
    states = [adapted.adapter_state(name) for name, _ in mixture]
    rank = sum(c.r for c in configs)
    config = LoraConfig(r=rank, alpha=float(rank), dropout=0.0, target_modules=configs[0].target_modules)
    tensors: dict[str, torch.Tensor] = {}
    for key in states[0]:
        if not key.endswith(".lora_A"):
            continue
        path = key[: -len(".lora_A")]
        A = torch.cat([s[f"{path}.lora_A"].float() for s in states], dim=0)  # (r_sum, d)
        B = torch.cat(
            [w * c.scaling * s[f"{path}.lora_B"].float()
             for (_, w), c, s in zip(mixture, configs, states, strict=True)],
            dim=1,
        )  # (o, r_sum)
        tensors[f"{path}.lora_A"], tensors[f"{path}.lora_B"] = A, B
    return config, tensors


def export_mixture(adapted: AdaptedModel, mixture: Sequence[tuple[str, float]], folder: str | Path) -> Path:
    """Write ``sum_k w_k * adapter_k`` as a PEFT adapter folder of rank ``sum_k r_k``."""
    config, tensors = concat_adapters(adapted, mixture)
    return write_adapter_folder(folder, config, tensors, adapted.base_model_name)
