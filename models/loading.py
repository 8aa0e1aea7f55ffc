"""Load a frozen base model and its tokenizer onto a device, under a dtype policy.

``load_base_model`` takes ``smollm2`` (the embedded default, prepared once by :mod:`models.prepare`),
``tiny`` (the seeded random Llama of :mod:`models.tiny`), a local Hugging Face model folder, or a hub
id where a network exists, and returns a :class:`LoadedModel`: the model in eval mode with every
parameter frozen, its tokenizer (with a pad token), and the dtype policy its forwards run under.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models import settings
from models.families import check_config, supported_text
from models.loaded import LoadedModel, frozen
from models.prepare import SMOLLM2, SMOLLM2_HUB_ID, ModelError, resolve_model_path
from models.tiny import tiny_llama


def load_base_model(
    name_or_path: str = SMOLLM2,
    dtype: settings.DType | None = None,
    cache: Path | None = None,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a frozen causal LM and its tokenizer onto a device.

    Args:
        name_or_path: ``smollm2`` (the embedded default), ``tiny`` (a seeded tiny random Llama for
            smoke runs), a local HF model folder, or a hub id (only where a network exists).
        dtype: ``float32``, ``bfloat16`` or ``autocast-bf16``; defaults to ``FEDMOSAIC_DTYPE``, else
            ``bfloat16`` on CUDA and, on the CPU, ``autocast-bf16`` where it has native bf16, else
            ``float32`` (:func:`settings.default_dtype`). The tiny model is float32 unless a dtype is given.
        cache: cache root for ``smollm2``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or a ``torch.device``; None reads
            ``FEDMOSAIC_DEVICE`` (default ``auto``: CUDA when torch sees a GPU).

    Raises:
        ModelError: the folder does not exist or holds no model.
        ValueError: an unknown dtype, or a device this machine does not have.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = settings.resolve_device(device)
    if dtype is not None and dtype not in settings.DTYPES:
        raise ValueError(f"dtype must be one of {settings.DTYPES}, got {dtype!r}")
    if name_or_path == "tiny":  # the seeded tiny random Llama: identical on every call, machine and device
        return tiny_llama(device=target, dtype=dtype or "float32")
    dtype = dtype or settings.default_dtype(target)
    path = resolve_model_path(name_or_path, cache)
    local = Path(path).expanduser()
    if (local.exists() or path.startswith((".", "/", "~"))) and not (local / "config.json").is_file():
        raise ModelError(f"{local} is not a Hugging Face model folder (no config.json)")
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    try:
        config = AutoConfig.from_pretrained(path)
    except ValueError as exc:  # a model_type this transformers does not know: named before any weight is read
        raise ModelError(f"cannot use model {name_or_path!r}: {_model_type(local)!r} is not an architecture "
                         f"transformers knows. Supported: {supported_text()}") from exc
    except OSError as exc:
        raise ModelError(f"cannot load model {name_or_path!r}: {exc}") from exc
    check_config(config, name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ModelError(f"cannot load model {name_or_path!r}: {exc}") from exc
    model.to(target)  # type: ignore[arg-type]  # transformers' @wraps'd .to reads unbound
    if path != name_or_path:
        # The cache folder differs per machine; adapters record the model's canonical name instead.
        model.config.name_or_path = SMOLLM2_HUB_ID
    return frozen(model, tokenizer, name_or_path, dtype)


def _model_type(folder: Path) -> str | None:
    """The ``model_type`` a local folder's config.json declares (None: unreadable or a hub id)."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
