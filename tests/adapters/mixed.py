"""Adapters of different target sets and ranks on the tiny model, and the naive reference they must equal.

The reference never touches :class:`adapters.MultiLoraLinear`: for each row it copies the plain base model,
adds ``sum_k w_k s_k B_k A_k`` (float64) to every Linear where adapter ``k`` has weights, and runs that row
alone through it: the per-adapter loop of ARCHITECTURE.md's contract, written out.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from adapters import AdaptedModel, LoraConfig, inject

# three adapters that differ in targets and rank: attention only, every Linear, and a regex on one MLP
MIXED: dict[str, LoraConfig] = {
    "qv": LoraConfig(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj")),
    "all": LoraConfig(r=2, alpha=6.0, dropout=0.0, target_modules="all-linear"),
    "mlp1": LoraConfig(r=6, alpha=3.0, dropout=0.0, target_modules=r"model\.layers\.1\.mlp\.(gate|down)_proj"),
}


def mixed_adapters(model: nn.Module, names: Sequence[str] = tuple(MIXED), seed: int = 0) -> AdaptedModel:
    """Inject the union of ``names``' targets into ``model`` and add each with a random non-zero B."""
    adapted = inject(model, *(MIXED[n].target_modules for n in names))
    for i, name in enumerate(names):
        adapted.add_adapter(name, MIXED[name], seed=seed + i)
        gen = torch.Generator().manual_seed(seed + 100 + i)
        for _, layer in adapted.adapter_layers(name):
            a = layer.adapters[name]
            layer.set_weights(name, a.lora_A.detach().clone(), torch.randn(a.lora_B.shape, generator=gen) * 0.3)
    return adapted


def states(adapted: AdaptedModel) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Each adapter's (scaling, ``{"<path>.lora_A": A, ...}``), copied, to build references from."""
    return {n: (c.scaling, {k: v.clone() for k, v in adapted.adapter_state(n).items()})
            for n, c in adapted.configs.items()}


def merged_logits(base: nn.Module, adapters: dict[str, tuple[float, dict[str, torch.Tensor]]],
                  ids: torch.Tensor, rows: Sequence[dict[str, float]]) -> torch.Tensor:
    """(B, T, V) logits, row ``b`` from a copy of the plain ``base`` with ``rows[b]``'s adapters merged in."""
    out = []
    for b, weights in enumerate(rows):
        model = copy.deepcopy(base)
        with torch.no_grad():
            for name, w in weights.items():
                scaling, state = adapters[name]
                for key, A in state.items():
                    if not key.endswith(".lora_A"):
                        continue
                    path = key[: -len(".lora_A")]
                    layer = model.get_submodule(path)
                    delta = w * scaling * (state[f"{path}.lora_B"].double() @ A.double())  # (o, d)
                    layer.weight.copy_((layer.weight.double() + delta).to(layer.weight.dtype))
            out.append(model(ids[b: b + 1]).logits)
    return torch.cat(out)
