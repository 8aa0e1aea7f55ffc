"""Process-wide settings read from the environment: cache and data folders, dtype, threads.

One place for the paths every command shares, so that tests, CLI and benchmarks agree. Values are
read when asked for (not at import), so a test can set an environment variable and see it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DType = Literal["float32", "bfloat16", "autocast-bf16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "autocast-bf16")

# Measured on the 2-core CPU machines (bench/dtype_speed.py): bf16 autocast runs a LoRA forward about
# twice as fast as fp32 while keeping fp32 master weights, so gradients and adapters stay fp32.
DEFAULT_DTYPE: DType = "autocast-bf16"


@dataclass(frozen=True)
class Paths:
    """Folders fedmosaic reads and writes.

    Attributes:
        cache_dir: prepared base models (safetensors + tokenizer), one sub-folder per model.
        data_dir: benchmark data (FedDPA datasets, Dolly split); may not exist.
    """

    cache_dir: Path
    data_dir: Path | None


def cache_dir() -> Path:
    """Return the model cache folder (``FEDMOSAIC_CACHE_DIR`` or ``~/.cache/fedmosaic``)."""
    env = os.environ.get("FEDMOSAIC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedmosaic"


def data_dir() -> Path | None:
    """Return the benchmark data folder, or None when there is none.

    ``FEDMOSAIC_DATA_DIR`` wins; otherwise ``../shared/data`` beside the repository when it exists.
    """
    env = os.environ.get("FEDMOSAIC_DATA_DIR")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parent.parent
    candidate = repo.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


def default_dtype() -> DType:
    """Return the compute dtype setting (``FEDMOSAIC_DTYPE`` or the measured default)."""
    value = os.environ.get("FEDMOSAIC_DTYPE", DEFAULT_DTYPE)
    if value not in DTYPES:
        raise ValueError(f"FEDMOSAIC_DTYPE must be one of {DTYPES}, got {value!r}")
    return value  # type: ignore[return-value]


def paths() -> Paths:
    """Return the current folders as one object."""
    return Paths(cache_dir=cache_dir(), data_dir=data_dir())
