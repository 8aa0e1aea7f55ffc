"""Save and load a FedAMoLE model: every expert, the token projections, each client's assignment.

Folder layout (paper 002; what the serving engine loads for AMoLE routing):

    amole_config.json         LoRA config of the experts, number of experts, top_k, shared flag, base model,
                              router kind (``amole``, or ``vanilla`` for FedAMoLE-A; absent: ``amole``)
    amole_model.safetensors   base_model.model.<path>.lora_A.<expert>.weight / lora_B, and
                              base_model.model.<path>.token_proj.weight (P (r, d), or W (N_e, d) vanilla)
    assignments.json          {client: {layer path: [expert ids]}}

Expert keys keep PEFT's naming with the adapter name inside, as PEFT's multi-adapter state dicts
do, so each expert is also extractable as a plain PEFT adapter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adapters.amole import Router
from adapters.amole_layer import (
    SHARED,
    add_amole_experts,
    check_router,
    expert_name,
    load_token_proj_state,
    token_proj_state,
)
from adapters.config import AdapterError, LoraConfig
from adapters.inject import AdaptedModel
from adapters.io import atomic_write

CONFIG = "amole_config.json"
WEIGHTS = "amole_model.safetensors"
ASSIGNMENTS = "assignments.json"
PREFIX = "base_model.model."

Assignments = Mapping[str, Mapping[str, tuple[int, ...] | list[int]]]


def save_amole(
    adapted: AdaptedModel, folder: str | Path, num_experts: int, assignments: Assignments, top_k: int = 2,
    router: Router = "amole",
) -> Path:
    """Write all experts, routers (token projections or vanilla routers) and ``assignments`` of an AMoLE model."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = [expert_name(j) for j in range(num_experts)]
    shared = SHARED in adapted.configs
    if shared:
        names.append(SHARED)
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        for key, value in adapted.adapter_state(name).items():
            path, _, which = key.rpartition(".")
            tensors[f"{PREFIX}{path}.{which}.{name}.weight"] = value.contiguous().cpu()
    for key, value in token_proj_state(adapted).items():
        tensors[f"{PREFIX}{key}.weight"] = value.contiguous().cpu()
    config = adapted.configs[names[0]]
    meta = {"lora": config.to_peft_dict(adapted.base_model_name), "num_experts": num_experts,
            "top_k": top_k, "shared_expert": shared, "router": check_router(router)}
    plain = {c: {p: sorted(int(j) for j in ids) for p, ids in a.items()} for c, a in assignments.items()}
    atomic_write(folder, WEIGHTS, lambda t: save_file(tensors, t, metadata={"format": "pt"}))
    atomic_write(folder, ASSIGNMENTS, lambda t: Path(t).write_text(json.dumps(plain, indent=1)))
    atomic_write(folder, CONFIG, lambda t: Path(t).write_text(json.dumps(meta, indent=2)))
    return folder


def read_amole_meta(folder: str | Path) -> dict[str, Any]:
    """Return the parsed ``amole_config.json`` of ``folder`` (raises AdapterError when absent)."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise AdapterError(f"{folder} is not an AMoLE folder (no {CONFIG})")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class AMoLEFolder:
    """The validated contents of an AMoLE folder, before any of it enters a model.

    Attributes:
        folder: where it was read from.
        config: the experts' LoRA config.
        num_experts: domain experts per module.
        top_k: experts gated per token.
        shared: whether a shared expert exists.
        router: ``amole`` (token projections P (r, d)) or ``vanilla`` (FedAMoLE-A: routers W (N_e, d)).
        base_model: the base model the run trained on (None when unrecorded).
        layers: the model's layer paths the experts target.
        state: every tensor of ``amole_model.safetensors`` by file key.
        assignments: client -> layer path -> expert ids.
    """

    folder: Path
    config: LoraConfig
    num_experts: int
    top_k: int
    shared: bool
    router: Router
    base_model: str | None
    layers: tuple[str, ...]
    state: dict[str, torch.Tensor]
    assignments: dict[str, dict[str, tuple[int, ...]]]

    @property
    def names(self) -> list[str]:
        """Expert adapter names: the domain experts, then the shared one."""
        return [expert_name(j) for j in range(self.num_experts)] + ([SHARED] if self.shared else [])

    def expert_state(self, name: str) -> dict[str, torch.Tensor]:
        """Expert ``name``'s ``{"<path>.lora_A" | "<path>.lora_B": tensor}`` over every target layer."""
        out = {}
        for path in self.layers:
            for which in ("lora_A", "lora_B"):
                key = f"{PREFIX}{path}.{which}.{name}.weight"
                if key not in self.state:
                    raise AdapterError(f"{self.folder / WEIGHTS} lacks {key}")
                out[f"{path}.{which}"] = self.state[key]
        return out

    def token_proj(self, path: str, in_features: int) -> torch.Tensor:
        """The router of layer ``path`` (P (r, d), or W (N_e, d) for ``vanilla``), checked against its input width."""
        P = self.state.get(f"{PREFIX}{path}.token_proj.weight")
        rows = self.num_experts if self.router == "vanilla" else self.config.r
        if P is None or P.shape != (rows, in_features):
            raise AdapterError(f"{self.folder / WEIGHTS}: token projection of {path} is missing or misshapen")
        return P


def read_amole(adapted: AdaptedModel, folder: str | Path) -> AMoLEFolder:
    """Read and validate an AMoLE folder against ``adapted`` (nothing is added to the model).

    Raises:
        AdapterError: a file is missing or unreadable, the experts target layers ``adapted`` lacks, or a
            client's assignment does not cover exactly those layers, is empty somewhere, or names an
            expert outside ``0..num_experts-1``.
    """
    folder = Path(folder)
    meta = read_amole_meta(folder)
    try:
        config = LoraConfig.from_peft_dict(meta["lora"])
        num_experts, top_k = int(meta["num_experts"]), int(meta["top_k"])
        shared = bool(meta["shared_expert"])
        router = check_router(str(meta.get("router", "amole")))  # folders written before FedAMoLE-A: amole
        raw = json.loads((folder / ASSIGNMENTS).read_text())
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise AdapterError(f"{folder} is not a complete AMoLE folder: {exc}") from exc
    if not (folder / WEIGHTS).is_file():
        raise AdapterError(f"{folder} lacks {WEIGHTS}")
    base = meta["lora"].get("base_model_name_or_path")
    layers = adapted.target_layers(config)
    return AMoLEFolder(folder, config, num_experts, top_k, shared, router, base or None, tuple(layers),
                       load_file(str(folder / WEIGHTS)), _check_assignments(raw, num_experts, set(layers), folder))


def _check_assignments(raw: object, num_experts: int, layers: set[str],
                       folder: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    if not isinstance(raw, dict) or not raw:
        raise AdapterError(f"{folder / ASSIGNMENTS} must map at least one client to its experts")
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for client, per_layer in raw.items():
        if not isinstance(per_layer, dict) or set(per_layer) != layers:
            raise AdapterError(f"{folder / ASSIGNMENTS}: client {client!r} must assign experts in all "
                               f"{len(layers)} AMoLE layers")
        ids = {p: tuple(int(j) for j in v) for p, v in per_layer.items()}
        if any(not v or not all(0 <= j < num_experts for j in v) for v in ids.values()):
            raise AdapterError(f"{folder / ASSIGNMENTS}: client {client!r} has an empty assignment or an "
                               f"expert id outside 0..{num_experts - 1}")
        out[str(client)] = ids
    return out


def load_amole(adapted: AdaptedModel, folder: str | Path) -> tuple[dict[str, dict[str, tuple[int, ...]]], int]:
    """Create the experts of ``folder`` in ``adapted``'s AMoLE layers and load them; return (assignments, top_k).

    The training-side loader (experts and token projections inside the layers); serving keeps several
    versions side by side instead (:mod:`serving.pool.amole`). The folder's router kind is
    :func:`read_amole_meta`'s ``router`` (route with ``AMoLERouting(router=...)``).
    """
    if any(n.startswith("expert_") for n in adapted.configs):
        raise AdapterError("this model already holds AMoLE experts; use a fresh injection")
    data = read_amole(adapted, folder)
    experts = {name: data.expert_state(name) for name in data.names}  # every check before the model changes
    proj = {f"{p}.token_proj": data.token_proj(p, adapted.layers[p].in_features) for p in data.layers}
    add_amole_experts(adapted, data.num_experts, data.config, shared=data.shared, router=data.router)
    for name, state in experts.items():
        adapted.load_adapter_state(name, state)
    load_token_proj_state(adapted, proj)
    return data.assignments, data.top_k
