"""Compiles serving.engine.kernels' Triton kernels ahead of time for an H100 (sm_90), with no GPU present.

Each launcher is called on meta tensors (shapes and strides only) at LLaMA-7B, SmolLM2 and tiny-model
decode sizes (bf16; float32 at the SmolLM2 size) while its kernels are swapped for recorders; every
recorded launch is then compiled by triton.compile for GPUTarget("cuda", 90, 32) with the same argument
types, specialisations and num_warps, down to a cubin, whose register and local-memory use cuobjdump
reports. This catches what
Triton's interpreter cannot: code the GPU compiler rejects, and register spills.

Run without TRITON_INTERPRET: `python -m tests.serving.engine.kernels.kernel_aot` prints one JSON object
{"kernels": [{"kernel", "signature", "constexprs", "num_warps", "registers", "local_bytes"}, ...]}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}


class Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch instead."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _record() -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """Runs every launcher on meta tensors at decode sizes and returns the kernel launches."""
    from serving.engine.kernels import triton_attention, triton_ops

    recorders: list[Recorder] = []
    for module in (triton_ops, triton_attention):
        for name in dir(module):
            if name.endswith("_kernel"):
                recorders.append(Recorder(getattr(module, name)))
                setattr(module, name, recorders[-1])

    def t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    i64 = torch.int64
    llama, smol, tiny = (4096, 11008, 32, 32, 128), (576, 1536, 9, 3, 64), (64, 128, 4, 2, 16)
    bf16, fp32 = torch.bfloat16, torch.float32
    for dt, (hidden, inter, hq, hkv, d) in ((bf16, llama), (bf16, smol), (bf16, tiny), (fp32, smol)):
        n, lmax = 8, 4096
        triton_ops.rms_norm(t(n, hidden, dtype=dt), t(hidden, dtype=dt), 1e-5, t(n, hidden, dtype=dt))
        triton_ops.rms_norm(t(n, hidden, dtype=dt), t(hidden, dtype=dt), 1e-5)
        triton_ops.silu_mul(t(n, 2 * inter, dtype=dt))
        cache = t(16, hkv, lmax, d, dtype=dt)
        triton_ops.rotary_kv_write(
            t(n, hq, d, dtype=dt), t(n, hkv, d, dtype=dt), t(n, hkv, d, dtype=dt), t(n, d, dtype=dt),
            t(n, d, dtype=dt), cache, cache, t(n, dtype=i64), t(n, dtype=i64),
        )
        one, batch = t(1, dtype=i64), t(64, dtype=i64)
        triton_attention.decode_attention(t(1, hq, d, dtype=dt), cache, cache, one, one, 0.1)  # 16 splits, merge
        short = cache[:, :, :256]  # a strided view: one split
        triton_attention.decode_attention(t(64, hq, d, dtype=dt), short, short, batch, batch, 0.1)
    return [(rec.kernel, *launch) for rec in recorders for launch in rec.launches]


def _spec(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What Triton's JIT would compile for one launch: signature, constexprs, attributes, options."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[param.name], constexprs[param.name] = "constexpr", value  # Triton specialises 1s too
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return {"kernel": kernel, "signature": signature, "constexprs": constexprs, "attrs": attrs, "options": options}


def _compile(spec: dict[str, Any]) -> dict[str, Any]:
    """Compiles one launch for sm_90 and reads the cubin's register and local-memory use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = spec["kernel"]
    source = ASTSource(kernel, spec["signature"], spec["constexprs"], spec["attrs"])
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True).stdout
    fields = dict(item.split(":", 1) for line in usage.splitlines() if "REG:" in line for item in line.split())
    return {
        "kernel": kernel.__name__,
        "signature": {k: v for k, v in spec["signature"].items() if v != "constexpr"},
        "constexprs": {k: str(v) for k, v in spec["constexprs"].items()},
        "num_warps": spec["options"].get("num_warps", 4),
        "registers": int(fields["REG"]),
        "local_bytes": int(fields["LOCAL"]) + int(fields["STACK"]),
    }


def main() -> None:
    """Records, deduplicates and compiles the launches; prints the JSON report."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter does not compile")
    specs: dict[str, dict[str, Any]] = {}
    for kernel, args, kwargs in _record():
        spec = _spec(kernel, args, kwargs)
        key = repr((kernel.__name__, spec["signature"], spec["constexprs"], spec["attrs"], spec["options"]))
        specs.setdefault(key, spec)
    report = [_compile(spec) for spec in specs.values()]
    print(json.dumps({"kernels": report}))


if __name__ == "__main__":
    main()
