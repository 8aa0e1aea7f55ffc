"""Process-wide settings read from the environment: the model cache folder, device, dtype.

One place for the paths every command shares, so that tests, CLI and benchmarks agree. Values are
read when asked for (not at import), so a test can set an environment variable and see it.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

if TYPE_CHECKING:
    import torch

DType = Literal["float32", "bfloat16", "autocast-bf16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "autocast-bf16")

# Measured with bench/training/dtype_speed.py on 2-core CPUs. With native bf16 (AVX512-BF16 or AMX) bf16 autocast
# runs a LoRA training step 1.65x and a decode 1.47x as fast as fp32, keeping fp32 master weights. Without
# it bf16 is emulated: on an Ice Lake Xeon (AVX-512, no BF16) autocast ran 0.37x (training) and 0.39x
# (decode) of fp32, so such CPUs default to fp32.
DEFAULT_DTYPE: DType = "autocast-bf16"
FALLBACK_CPU_DTYPE: DType = "float32"
# On a GPU bf16 weights halve the bytes every decode step reads and run on the tensor cores; adapters stay
# fp32 masters and compute in the activations' dtype (adapters.layer), so training updates keep fp32.
CUDA_DTYPE: DType = "bfloat16"

DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
DEVICE_HELP = (f"{DEVICE_FORMS} (default: FEDMOSAIC_DEVICE, else auto = cuda when torch sees a GPU, "
               "else cpu)")
_DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")


def cache_dir() -> Path:
    """Return the model cache folder (``FEDMOSAIC_CACHE_DIR`` or ``~/.cache/fedmosaic``)."""
    env = os.environ.get("FEDMOSAIC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedmosaic"


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 in hardware (x86 AVX512-BF16 or AMX tiles), as torch reports it."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    # torch.cpu's probes are private: a torch without them is treated as having no native bf16 (fp32 is
    # never the slow choice, emulated bf16 can be).
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def default_dtype(device: torch.device | str | None = None) -> DType:
    """Return the compute dtype setting: ``FEDMOSAIC_DTYPE``, else the measured default for the device.

    Args:
        device: where the model runs; on CUDA the default is ``bfloat16``; on a CPU ``autocast-bf16``
            when it has native bf16 (:func:`cpu_has_native_bf16`), else ``float32``.
    """
    value = os.environ.get("FEDMOSAIC_DTYPE")
    if value is None:
        kind = device if isinstance(device, str) else getattr(device, "type", "cpu")
        if str(kind).startswith("cuda"):
            return CUDA_DTYPE
        return DEFAULT_DTYPE if cpu_has_native_bf16() else FALLBACK_CPU_DTYPE
    if value not in DTYPES:
        raise ValueError(f"FEDMOSAIC_DTYPE must be one of {DTYPES}, got {value!r}")
    return cast(DType, value)  # one of DTYPES, the values of DType


def check_device_spec(spec: str, source: str = "device") -> str:
    """Return ``spec`` when it is a device setting's syntax (``auto``, ``cpu``, ``cuda``, ``cuda:N``).

    Args:
        spec: the text to check.
        source: what gave it, for the error (an option or an environment variable).

    Raises:
        ValueError: any other text (``gpu``, ``cuda0``, ``mps``), naming the accepted forms.
    """
    if not isinstance(spec, str) or not _DEVICE_SPEC.match(spec):
        raise ValueError(f"{source} must be {DEVICE_FORMS}, got {spec!r}")
    return spec


def default_device() -> str:
    """Return the device setting (``FEDMOSAIC_DEVICE``, default ``auto``), checked but not resolved."""
    return check_device_spec(os.environ.get("FEDMOSAIC_DEVICE") or "auto", "FEDMOSAIC_DEVICE")


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """Turn a device setting into the ``torch.device`` the model will live on.

    Args:
        spec: ``auto`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``cpu``, ``cuda``
            (the current CUDA device), ``cuda:N``, a ``torch.device``, or None for
            :func:`default_device`.

    Returns:
        ``cpu`` or ``cuda:N`` with an explicit index, so ``str()`` of it is what a run records.

    Raises:
        ValueError: the text is not a device setting, or it names a CUDA device this machine lacks.
    """
    import torch

    if spec is None:
        spec = default_device()
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = check_device_spec(spec)
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else " has no CUDA support")
        raise ValueError(f"device {spec!r} asked for, but torch sees no CUDA device ({build}); "
                         "use --device cpu (or auto), or install a CUDA build of torch (docs/gpu.md)")
    count = torch.cuda.device_count()
    index = int(text.partition(":")[2]) if ":" in text else torch.cuda.current_device()
    if index >= count:
        raise ValueError(f"device {spec!r} does not exist: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def device_option(text: str) -> str:
    """``argparse`` type of the ``--device`` options: the spec, refused at once when it names no device here.

    Returns the text (not the resolved device) so that commands pass it on unchanged to their children.
    """
    try:
        resolve_device(check_device_spec(text, "--device"))
        return text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc

