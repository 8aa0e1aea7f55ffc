"""Qwen3's per-head RMSNorm of the queries and keys, before the rotary embedding, for the fused runner.

Qwen3 (``Qwen3Attention``) normalises each head's query and key over the head dimension with its own
``q_norm`` / ``k_norm`` weight (D,) right after the projections; Llama, Mistral and Qwen2 have neither. The
norm is Llama's RMSNorm on (N * heads, D) rows, so the runner's RMSNorm kernel computes it with HF's
rounding points (float32 variance, the weight applied after the cast back).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from serving.engine import kernels

NORMS = ("Qwen3RMSNorm",)
QKNorm = tuple[torch.Tensor, torch.Tensor, float, float]  # q weight (D,), k weight (D,), q eps, k eps


def qk_norm_problem(layers: Sequence[nn.Module]) -> str | None:
    """Why the layers' q/k norms (where they have them) are not ones the runner computes, or None."""
    for layer in layers:
        attn = layer.self_attn
        found = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if all(m is None for m in found):
            continue
        kinds = {type(m).__name__ for m in found}
        if not kinds <= set(NORMS):
            return f"q/k norm layers {sorted(kinds)} are not per-head RMSNorm"
    return None


def qk_norms(attn: nn.Module) -> QKNorm | None:
    """An attention module's (q weight, k weight, q eps, k eps), or None when it has no q/k norm."""
    q, k = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q is None or k is None:
        return None
    return q.weight, k.weight, float(q.variance_epsilon), float(k.variance_epsilon)


def apply_qk_norm(q: torch.Tensor, k: torch.Tensor, norms: QKNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, Hq, D) queries and (N, Hkv, D) keys, each head normalised over D (unchanged without ``norms``)."""
    if norms is None:
        return q, k
    wq, wk, eps_q, eps_k = norms
    n, d = q.shape[0], q.shape[-1]
    q = kernels.rms_norm(q.reshape(-1, d), wq, eps_q)[0].view(n, -1, d)
    k = kernels.rms_norm(k.reshape(-1, d), wk, eps_k)[0].view(n, -1, d)
    return q, k
