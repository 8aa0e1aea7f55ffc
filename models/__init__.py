"""Base models: the bottom layer every other package loads its frozen LLM from.

Imports torch and transformers only (no package of ours), beside :mod:`adapters` at the bottom of the
layers (``ARCHITECTURE.md``):

* :mod:`models.settings`: the environment's cache and data folders, device and dtype policy;
* :mod:`models.prepare`: the embedded SmolLM2 GGUF, dequantized once into a verified cache;
* :mod:`models.loaded`: :class:`LoadedModel` (frozen model, tokenizer, dtype) and :func:`frozen`, which makes one;
* :mod:`models.loading`: :func:`load_base_model`, the embedded SmolLM2, a folder, a hub id or the tiny model;
* :mod:`models.tiny`: the seeded tiny random Llama and its offline tokenizer, for tests and examples.
"""

from models.loaded import LoadedModel, compute_context
from models.loading import load_base_model
from models.prepare import SMOLLM2, ModelError, prepare_smollm2, resolve_model_path
from models.tiny import save_tiny_llama, tiny_llama, tiny_tokenizer

__all__ = [
    "SMOLLM2", "LoadedModel", "ModelError", "compute_context", "load_base_model", "prepare_smollm2",
    "resolve_model_path", "save_tiny_llama", "tiny_llama", "tiny_tokenizer",
]
