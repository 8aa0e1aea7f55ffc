"""Fused kernels of the decode step, each with its plain-PyTorch reference.

The functions here dispatch: Triton kernels (serving.engine.kernels.triton_ops, triton_attention)
when the tensors are on CUDA and triton imports, else the PyTorch reference
(serving.engine.kernels.reference), which is the CPU path and the semantics. With
FEDMOSAIC_TRITON_INTERPRET=1 in the environment, CPU tensors also take the Triton path, through
Triton's interpreter (for tests: if triton is not imported yet, the first such call sets
TRITON_INTERPRET=1 for the whole process, so CUDA tensors then fall back to the reference).
`uses_triton` says which path a tensor takes.

Every function is CUDA-graph capturable on both paths (no host synchronisation, shapes only).
prefill_attention always runs the reference. The adapter GEMMs are not here: they are two plain
matrix products over the stacked slots (:class:`serving.engine.runner.lora_slots.LoraSlots`).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

from serving.engine.kernels import reference

__all__ = [
    "INTERPRET_ENV",
    "decode_attention",
    "prefill_attention",
    "reference",
    "rms_norm",
    "rotary_kv_write",
    "silu_mul",
    "uses_triton",
]

INTERPRET_ENV = "FEDMOSAIC_TRITON_INTERPRET"

# The Triton modules once imported: "ops", "attention" (None when triton does not import).
_TRITON: dict[str, ModuleType | None] = {}


def _triton_modules(cpu: bool) -> dict[str, ModuleType | None]:
    """Imports the Triton modules on first use (setting TRITON_INTERPRET first for a CPU call)."""
    if not _TRITON:
        if cpu and "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            from serving.engine.kernels import triton_attention, triton_ops
        except ImportError:
            _TRITON.update(ops=None, attention=None)
        else:
            _TRITON.update(ops=triton_ops, attention=triton_attention)
    return _TRITON


def _triton(name: str) -> ModuleType:
    """The Triton module ``name`` ("ops" or "attention") for a call :func:`uses_triton` sent to Triton."""
    module = _TRITON[name]
    assert module is not None  # uses_triton is True only when the import succeeded
    return module


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the functions here run Triton kernels for tensors on t's device.

    Args:
        t: any input tensor of the call.

    Returns:
        True on CUDA when triton imports compiled; on CPU when FEDMOSAIC_TRITON_INTERPRET=1 and triton
        runs in its interpreter.
    """
    if t.is_cuda:
        ops = _triton_modules(cpu=False)["ops"]
        return ops is not None and not ops.INTERPRETED
    if os.environ.get(INTERPRET_ENV) == "1":
        ops = _triton_modules(cpu=True)["ops"]
        return ops is not None and ops.INTERPRETED
    return False


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add (optional) then LlamaRMSNorm: see reference.rms_norm.

    Args:
        x: (N, H) hidden states.
        weight: (H,) norm weight.
        eps: variance epsilon.
        residual: (N, H) residual in x.dtype, added to x first (rounded once), or None.

    Returns:
        (out, residual_out): out (N, H); residual_out (N, H) = x + residual (x itself without residual).
    """
    if uses_triton(x):
        return _triton("ops").rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """HF rotary on q and k, rotated k and v written into the caches: see reference.rotary_kv_write.

    Args:
        q: (N, Hq, D) queries.
        k: (N, Hkv, D) keys.
        v: (N, Hkv, D) values.
        cos: (N, D) per-token cosines in the activation dtype.
        sin: (N, D) per-token sines.
        k_cache: (S, Hkv, Lmax, D) written at [slots[n], :, positions[n]].
        v_cache: (S, Hkv, Lmax, D) written likewise.
        slots: (N,) int64 cache rows.
        positions: (N,) int64 positions in the rows.

    Returns:
        (N, Hq, D) rotated queries.
    """
    if uses_triton(q):
        return _triton("ops").rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots, positions)
    return reference.rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots, positions)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused (N, 2I) [gate | up] projection: see reference.silu_mul.

    Args:
        gate_up: (N, 2I).

    Returns:
        (N, I).
    """
    if uses_triton(gate_up):
        return _triton("ops").silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per row over its cache row, GQA: see reference.decode_attention.

    Args:
        q: (B, Hq, D) queries (Hq = G * Hkv).
        k_cache: (S, Hkv, Lmax, D) key cache.
        v_cache: (S, Hkv, Lmax, D) value cache.
        slots: (B,) int64 cache rows.
        lengths: (B,) int64 valid positions per row (>= 1).
        scale: score scale.

    Returns:
        (B, Hq, D) in q.dtype.
    """
    if uses_triton(q):
        return _triton("attention").decode_attention(q, k_cache, v_cache, slots, lengths, scale)
    return reference.decode_attention(q, k_cache, v_cache, slots, lengths, scale)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal chunked-prefill attention over the cache rows: see reference.prefill_attention.

    Args:
        q: (B, T, Hq, D) each row's new chunk (padded to T).
        k_cache: (S, Hkv, Lmax, D) key cache, the chunk already written.
        v_cache: (S, Hkv, Lmax, D) value cache.
        slots: (B,) int64 cache rows.
        starts: (B,) int64 position of each chunk's first token.
        lengths: (B,) int64 starts + real chunk lengths.
        scale: score scale.

    Returns:
        (B, T, Hq, D) in q.dtype (padded queries: finite, meaningless).
    """
    return reference.prefill_attention(q, k_cache, v_cache, slots, starts, lengths, scale)
