"""Base models: the bottom layer every other package loads its frozen LLM from.

Imports torch and transformers only (no package of ours), beside :mod:`adapters` at the bottom of the
layers (``ARCHITECTURE.md``):

* :mod:`models.settings`: the environment's cache and data folders, device and dtype policy;
* :mod:`models.prepare`: the embedded SmolLM2 GGUF, dequantized once into a verified cache;
* :mod:`models.loaded`: :class:`LoadedModel` (frozen model, tokenizer, dtype) and :func:`frozen`, which makes one;
* :mod:`models.loading`: :func:`load_base_model`, the embedded SmolLM2, a folder, a hub id or the tiny model;
* :mod:`models.tiny`: the seeded tiny random Llama and its offline tokenizer, for tests and examples.

The names below load their module on first use (PEP 562), so ``from models import settings`` (every
command's ``--help``) imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.loaded import LoadedModel, compute_context
    from models.loading import load_base_model
    from models.prepare import SMOLLM2, ModelError, prepare_smollm2, resolve_model_path
    from models.tiny import save_tiny_llama, tiny_llama, tiny_tokenizer

_HOME = {"LoadedModel": "loaded", "compute_context": "loaded", "load_base_model": "loading", "SMOLLM2": "prepare",
         "ModelError": "prepare", "prepare_smollm2": "prepare", "resolve_model_path": "prepare",
         "save_tiny_llama": "tiny", "tiny_llama": "tiny", "tiny_tokenizer": "tiny"}

__all__ = [
    "SMOLLM2", "LoadedModel", "ModelError", "compute_context", "load_base_model", "prepare_smollm2",
    "resolve_model_path", "save_tiny_llama", "tiny_llama", "tiny_tokenizer",
]


def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` (one of ``__all__``) when it is first asked for."""
    if name not in _HOME:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"models.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
