"""Save and load a FedAMoLE model: every expert, the token projections, each client's assignment.

Folder layout (paper 002; what the serving engine loads for AMoLE routing):

    amole_config.json         LoRA config of the experts, number of experts, top_k, shared flag, base model
    amole_model.safetensors   base_model.model.<path>.lora_A.<expert>.weight / lora_B, and
                              base_model.model.<path>.token_proj.weight
    assignments.json          {client: {layer path: [expert ids]}}

Expert keys keep PEFT's naming with the adapter name inside, as PEFT's multi-adapter state dicts
do, so each expert is also extractable as a plain PEFT adapter.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adapters.amole_layer import SHARED, add_amole_experts, expert_name, load_token_proj_state, token_proj_state
from adapters.config import AdapterError, LoraConfig
from adapters.inject import AdaptedModel

CONFIG = "amole_config.json"
WEIGHTS = "amole_model.safetensors"
ASSIGNMENTS = "assignments.json"
PREFIX = "base_model.model."

Assignments = Mapping[str, Mapping[str, tuple[int, ...] | list[int]]]


def _atomic_write(folder: Path, name: str, write) -> None:  # noqa: ANN001
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    os.close(fd)
    write(tmp)
    os.replace(tmp, folder / name)


def save_amole(
    adapted: AdaptedModel, folder: str | Path, num_experts: int, assignments: Assignments, top_k: int = 2
) -> Path:
    """Write all experts, token projections and ``assignments`` of an AMoLE model."""
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
            "top_k": top_k, "shared_expert": shared}
    plain = {c: {p: sorted(int(j) for j in ids) for p, ids in a.items()} for c, a in assignments.items()}
    _atomic_write(folder, WEIGHTS, lambda t: save_file(tensors, t, metadata={"format": "pt"}))
    _atomic_write(folder, ASSIGNMENTS, lambda t: Path(t).write_text(json.dumps(plain, indent=1)))
    _atomic_write(folder, CONFIG, lambda t: Path(t).write_text(json.dumps(meta, indent=2)))
    return folder


def read_amole_meta(folder: str | Path) -> dict[str, object]:
    """Return the parsed ``amole_config.json`` of ``folder`` (raises AdapterError when absent)."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise AdapterError(f"{folder} is not an AMoLE folder (no {CONFIG})")
    return json.loads(path.read_text())


def load_amole(adapted: AdaptedModel, folder: str | Path) -> tuple[dict[str, dict[str, tuple[int, ...]]], int]:
    """Create the experts of ``folder`` in ``adapted`` and load them; return (assignments, top_k)."""
    folder = Path(folder)
    meta = read_amole_meta(folder)
    config = LoraConfig.from_peft_dict(meta["lora"])  # type: ignore[arg-type]
    num_experts = int(meta["num_experts"])  # type: ignore[arg-type]
    state = load_file(str(folder / WEIGHTS))
    present = [n for n in adapted.configs if n.startswith("expert_")]
    if present:
        raise AdapterError(f"this model already holds AMoLE experts ({len(present)}); use a fresh injection")
    add_amole_experts(adapted, num_experts, config, shared=bool(meta["shared_expert"]))
    names = [expert_name(j) for j in range(num_experts)] + ([SHARED] if meta["shared_expert"] else [])
    for name in names:
        sub = {}
        for key in adapted.adapter_state(name):
            path, _, which = key.rpartition(".")
            file_key = f"{PREFIX}{path}.{which}.{name}.weight"
            if file_key not in state:
                raise AdapterError(f"{folder / WEIGHTS} lacks {file_key}")
            sub[key] = state[file_key]
        adapted.load_adapter_state(name, sub)
    proj = {k[len(PREFIX):-len(".weight")]: v for k, v in state.items() if k.endswith(".token_proj.weight")}
    load_token_proj_state(adapted, proj)
    raw = json.loads((folder / ASSIGNMENTS).read_text())
    assignments = {c: {p: tuple(ids) for p, ids in a.items()} for c, a in raw.items()}
    for client, a in assignments.items():
        bad = [j for ids in a.values() for j in ids if not 0 <= j < num_experts]
        if bad or set(a) - set(adapted.layers):
            raise AdapterError(f"{folder / ASSIGNMENTS}: client {client!r} names unknown experts or layers")
    return assignments, int(meta["top_k"])  # type: ignore[arg-type]
