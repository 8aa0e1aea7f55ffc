"""Save and load adapters in PEFT's folder format (``adapter_config.json`` + ``adapter_model.safetensors``).

Keys follow PEFT exactly: ``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``, so
``peft.PeftModel.from_pretrained`` loads what we save and we load what PEFT saves. Loading checks
everything before copying anything: config support, base model, missing and extra keys, shapes
against the base layers, NaN/inf, so a bad file never leaves a half-loaded adapter behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adapters.config import AdapterError, LoraConfig
from adapters.inject import AdaptedModel

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20  # PEFT's configs are a few hundred bytes
MAX_CONFIG_DEPTH = 8  # PEFT's deepest fields (rank_pattern, layer_replication) nest two or three levels


def peft_key(path: str, which: str) -> str:
    """Return PEFT's state-dict key for module ``path`` and ``which`` in (``lora_A``, ``lora_B``)."""
    return f"{PREFIX}{path}.{which}.weight"


def parse_peft_key(key: str) -> tuple[str, str]:
    """Split a PEFT key into (module path, ``lora_A``/``lora_B``); accepts an adapter-name segment."""
    body = key[len(PREFIX):] if key.startswith(PREFIX) else key
    parts = body.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("lora_A", "lora_B"):
            tail = parts[i + 1:]
            if tail in (["weight"], [tail[0], "weight"]) and tail:
                return ".".join(parts[:i]), parts[i]
    raise AdapterError(f"{key!r} is not a LoRA A/B weight key")


def write_adapter_folder(
    folder: str | Path, config: LoraConfig, tensors: Mapping[str, torch.Tensor], base_model: str | None
) -> Path:
    """Write a PEFT adapter folder from ``{"<path>.lora_A": A, "<path>.lora_B": B}`` tensors.

    Each file is written to a temporary name, fsync'ed and renamed (:func:`atomic_write`), so a crash never
    leaves a torn adapter.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, value in tensors.items():
        path, _, which = key.rpartition(".")
        if not torch.isfinite(value).all():
            raise AdapterError(f"refusing to save {key}: it contains NaN or inf")
        state[peft_key(path, which)] = value.detach().to("cpu").contiguous()
    atomic_write(folder, WEIGHTS_FILE, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write(folder, CONFIG_FILE, lambda tmp: Path(tmp).write_text(
        json.dumps(config.to_peft_dict(base_model), indent=2)))
    return folder


def atomic_write(folder: Path, name: str, write: Callable[[str], object]) -> None:
    """Write ``folder / name`` through ``write(tmp_path)``: a temporary file beside it, fsync'ed, renamed
    into place, and the folder fsync'ed, so a crash leaves the old file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # a rename is durable once the directory entry is on disk (POSIX)
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_adapter(adapted: AdaptedModel, name: str, folder: str | Path) -> Path:
    """Save adapter ``name`` of ``adapted`` as a PEFT folder; returns the folder."""
    adapted._require(name)
    return write_adapter_folder(folder, adapted.configs[name], adapted.adapter_state(name), adapted.base_model_name)


def read_adapter_folder(folder: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor], dict[str, object]]:
    """Read a PEFT adapter folder into (config, ``{"<path>.lora_A": A, ...}``, raw config dict)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}")
    if not weights_path.is_file():
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}")
    config, raw = read_adapter_config(folder)
    try:
        state = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises several types for torn files
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {exc}") from exc
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        path, which = parse_peft_key(key)
        tensors[f"{path}.{which}"] = value
    return config, tensors, raw


def read_adapter_config(folder: str | Path) -> tuple[LoraConfig, dict[str, Any]]:
    """Read and type-check ``folder``'s ``adapter_config.json``: (config, the raw JSON object).

    Raises:
        AdapterError: the file is missing, over ``MAX_CONFIG_BYTES``, not UTF-8 JSON, nested deeper than
            ``MAX_CONFIG_DEPTH``, not a LoRA config, or a field has the wrong type (named).
    """
    config_path = Path(folder) / CONFIG_FILE
    try:
        with open(config_path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterError(f"cannot read {config_path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{config_path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise AdapterError(f"{config_path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{config_path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise AdapterError(f"{config_path} nests deeper than {MAX_CONFIG_DEPTH} levels") from exc
    if _depth(raw) > MAX_CONFIG_DEPTH:
        raise AdapterError(f"{config_path} nests deeper than {MAX_CONFIG_DEPTH} levels")
    if not isinstance(raw, dict) or "r" not in raw:
        raise AdapterError(f"{config_path} is not a LoRA adapter config (no 'r')")
    return LoraConfig.from_peft_dict(raw), raw


def _depth(value: object) -> int:
    """How deeply lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children)
    return deepest


def same_base(recorded: str, ours: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names this model: the same name, or the same last path
    component (a Hub id such as ``org/Model-1B`` and a local copy in a folder ``.../Model-1B``), case aside."""
    def last(name: str) -> str:
        return name.rstrip("/\\").replace("\\", "/").rpartition("/")[2].lower()

    return recorded == ours or last(recorded) == last(ours) != ""


def load_adapter(
    adapted: AdaptedModel,
    folder: str | Path,
    name: str,
    check_base: bool = True,
    replace: bool = False,
) -> LoraConfig:
    """Load a PEFT adapter folder into ``adapted`` under ``name``.

    Args:
        adapted: the injected model.
        folder: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        name: the adapter name to create.
        check_base: refuse an adapter whose ``base_model_name_or_path`` names another model.
        replace: overwrite an existing adapter of that name.

    Raises:
        AdapterError: unsupported config, other base model, missing/extra keys, shape mismatch,
            NaN/inf; nothing is changed then.
    """
    config, tensors, raw = read_adapter_folder(folder)
    base = raw.get("base_model_name_or_path")
    ours = adapted.base_model_name
    if check_base and base and ours and not same_base(str(base), ours):
        raise AdapterError(
            f"adapter {folder} was trained on base model {base!r}, this model is {ours!r} "
            "(fedmosaic serve --no-check-base, or check_base=False, loads it anyway)"
        )
    layers = adapted.target_layers(config)
    expected = {f"{p}.{w}" for p in layers for w in ("lora_A", "lora_B")}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise AdapterError(
            f"adapter {folder} does not fit this model: {len(missing)} missing keys "
            f"{missing[:3]}, {len(extra)} unexpected keys {extra[:3]}"
        )
    for path, layer in layers.items():
        A, B = tensors[f"{path}.lora_A"], tensors[f"{path}.lora_B"]
        want_a, want_b = (config.r, layer.in_features), (layer.out_features, config.r)
        if tuple(A.shape) != want_a or tuple(B.shape) != want_b:
            raise AdapterError(
                f"adapter {folder}: {path} has lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)}, "
                f"expected {want_a} / {want_b} for rank {config.r} on a {layer.in_features}->"
                f"{layer.out_features} layer (wrong base model or rank?)"
            )
        if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
            raise AdapterError(f"adapter {folder}: {path} weights contain NaN or inf")
    if name in adapted.configs:
        if not replace:
            raise AdapterError(f"adapter {name!r} is already loaded (pass replace=True to overwrite)")
        adapted.delete_adapter(name)
    adapted.add_adapter(name, config)
    for path, layer in layers.items():
        dtype = layer.adapters[name].lora_A.dtype
        layer.set_weights(name, tensors[f"{path}.lora_A"].to(dtype), tensors[f"{path}.lora_B"].to(dtype))
    return config
