"""How the fused runner stores the model's weight matrices: fused groups, storage order, compute copies.

The runner never keeps a second full copy of the model. q/k/v (and gate/up) become views of one
fused matrix each, shared with the HF modules, so both forwards read the same memory.

Storage order. ``F.linear(x, W)`` with ``W`` stored row-major ``(out, in)`` asks BLAS
for ``x @ W^T``. On CPU, oneMKL's fp32 GEMM for the few rows of a decode step is far slower in that
transposed form than in the plain one: ``bench/serving/gemm_layout.py`` on a 2-core Ice Lake Xeon timed one
pass over SmolLM2's matrices (30 layers and the head) at 100 ms for 8 rows stored row-major against 56
ms stored in-feature-major, ``(in, out)`` contiguous (1.8x; 16 rows 1.8x, 1 row 1.1x; 64 rows and a
392-token prefill within noise, 0.96-0.99). The adapter slots' ``A`` stacks follow the same order
(:mod:`serving.engine.runner.lora_slots`; 6x for their small products). So on CPU in float32
the runner re-stores each matrix in-feature-major (one matrix at a time: the transient memory is one
matrix, not the model) and hands the HF modules its ``(out, in)`` transposed view: same shapes, same
values, the same products (a view changes which BLAS routine runs, not the arithmetic of any one
product up to its summation order). Other dtypes and devices keep the row-major order, where it was
measured (bf16 on CPU was slower in-feature-major; cuBLAS takes either order at full speed).
The tied embedding / LM head matrix is not re-stored (the embedding gathers its rows); the head is
computed as ``(W @ h^T)^T`` instead, the fast form for that storage.

Packed bf16 on CPU. Under ``autocast-bf16`` the runner computes from bf16 copies of the matrices that
nobody else reads, so their form is free to choose: oneDNN's blocked ("packed") form, which its GEMM
reads as it is, where a plain ``(out, in)`` bf16 matrix is re-blocked inside every ``F.linear`` call.
On the 2-vCPU AMX Xeon one pass over SmolLM2's matrices took 15.4 ms packed against 23.4 ms plain for 8
rows (1.5x; 1 to 64 rows 1.48-1.52x, a 392-token prefill 1.00x; ``bench/serving/gemm_layout.py --dtype bfloat16``),
with the same products bit for bit at those sizes; a decode step of 8 rows went from 40.8 to 30.5 ms.
:func:`packs` says where the form is available (checked once, falling back to plain copies where the
oneDNN operator is missing or disagrees with ``F.linear``), :func:`packed_copy` makes one, and
:func:`linear` computes with either form.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def in_feature_major(device: torch.device, dtype: torch.dtype) -> bool:
    """True when weights computed in ``dtype`` on ``device`` are best stored ``(in, out)`` contiguous."""
    return device.type == "cpu" and dtype == torch.float32


def _is_in_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride() == (1, t.shape[0])


def fuse(linears: Sequence[nn.Linear], attr: str, in_major: bool = False) -> torch.Tensor | None:
    """One ``(sum of outs, in)`` matrix whose row blocks are the Linears' ``attr``; the Linears then hold
    views of it (no second copy). In-feature-major storage with ``in_major`` (2-D weights only).

    An existing fusion in the requested order (another engine on the same model) is returned as it is.
    """
    tensors = [getattr(lin, attr) for lin in linears]
    if tensors[0] is None:
        return None
    in_major = in_major and tensors[0].dim() == 2
    fused = getattr(linears[0], f"_fedmosaic_fused_{attr}", None)
    if fused is not None and _views_of(fused, tensors, in_major):
        return fused
    with torch.inference_mode(False), torch.no_grad():
        if in_major:  # (in, sum outs) contiguous; each Linear's weight is a column block, transposed
            storage = torch.cat([t.detach().t() for t in tensors], dim=1)
            fused = storage.t()
        else:
            fused = torch.cat([t.detach() for t in tensors])
        start = 0
        for lin, t in zip(linears, tensors, strict=True):
            setattr(lin, attr, nn.Parameter(fused[start: start + t.shape[0]], requires_grad=False))
            start += t.shape[0]
    linears[0].__dict__[f"_fedmosaic_fused_{attr}"] = fused  # plain attribute: not a parameter or buffer
    return fused


def _views_of(fused: torch.Tensor, tensors: Sequence[torch.Tensor], in_major: bool) -> bool:
    """True when ``tensors`` are still, in order, the row blocks of ``fused`` in the requested storage."""
    if _is_in_major(fused) != in_major and fused.dim() == 2:
        return False
    start = 0
    for t in tensors:
        block = fused[start: start + t.shape[0]]
        if t.data_ptr() != block.data_ptr() or t.shape != block.shape or t.stride() != block.stride():
            return False
        start += t.shape[0]
    return start == fused.shape[0]


def reorder(linear: nn.Linear, in_major: bool) -> torch.Tensor:
    """``linear.weight`` in the requested storage order (re-stored in place when needed); returns it."""
    weight = linear.weight
    if _is_in_major(weight) == in_major or weight.dim() != 2:
        return weight
    with torch.inference_mode(False), torch.no_grad():
        data = weight.detach().t().contiguous().t() if in_major else weight.detach().contiguous()
        linear.weight = nn.Parameter(data, requires_grad=False)
    return linear.weight


def head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_major: bool) -> torch.Tensor:
    """(N, V) logits of (N, H) states for a row-major (V, H) head ``weight``.

    With ``in_major`` (CPU float32) the product runs as ``(W @ h^T)^T``, the plain GEMM form for a
    row-major ``W`` (1.7x faster than ``h @ W^T`` for 8 rows of SmolLM2's 49,152 x 576 head).
    """
    if weight.is_mkldnn or not in_major or _is_in_major(weight):
        return linear(h, weight, bias)
    logits = torch.mm(weight, twice(h).t()).t()[:1] if lone_row(h) else torch.mm(weight, h.t()).t()
    return logits + bias if bias is not None else logits


def compute_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` (row-major), made once per weight and shared by every engine on the model
    (remade when the weight changed in place since)."""
    return _cached_copy(weight, dtype, "_fedmosaic_compute_copy", lambda w: w.to(dtype).contiguous())


def _cached_copy(weight: torch.Tensor, dtype: torch.dtype, attr: str,
                 make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(weight)``, kept on ``weight`` under ``attr`` with ``dtype`` and the weight's in-place version;
    an inference tensor, which keeps no version, gets a new copy each time."""
    versioned = not weight.is_inference()
    cached = getattr(weight, attr, None) if versioned else None
    if cached is not None and cached[0] == dtype and cached[1] == weight._version:
        return cached[2]
    with torch.inference_mode(False), torch.no_grad():  # one plain copy at a time: the transient memory
        copy = make(weight.detach())
    if versioned:
        setattr(weight, attr, (dtype, weight._version, copy))
    return copy


def forget_compute_copy(weight: torch.Tensor, copy: torch.Tensor) -> None:
    """Drop ``weight``'s cached compute copy when it is ``copy`` (its one reader has copied it elsewhere,
    the adapter slots' ``[W; A]``), so the memory is freed; a later :func:`compute_copy` makes a new one."""
    cached = getattr(weight, "_fedmosaic_compute_copy", None)
    if cached is not None and cached[2] is copy:
        del weight._fedmosaic_compute_copy  # type: ignore[attr-defined]  # set by _cached_copy, not a Tensor member


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """True when the runner's own ``dtype`` copies on ``device`` are best held packed (CPU bf16, oneDNN)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _packed_linear_works()


@functools.cache
def _packed_linear_works() -> bool:
    """oneDNN's packed linear exists in this torch build and gives ``F.linear``'s products."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(48, 32, generator=gen) / 8).to(torch.bfloat16)
        x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
        with torch.inference_mode(False), torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        works = torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # no oneDNN, or no bf16 kernel here
        logger.info("oneDNN's packed bf16 linear is unavailable (%s): the runner keeps plain bf16 copies", e)
        return False
    if not works:
        logger.warning("oneDNN's packed bf16 linear disagrees with F.linear here: the runner keeps plain copies")
    return works


def packed_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` and oneDNN's packed form, for :func:`linear`; made once per weight and shared
    by every engine on the model like :func:`compute_copy`. Call where :func:`packs`.
    """
    return _cached_copy(weight, dtype, "_fedmosaic_packed_copy", lambda w: pack(w, dtype))


def pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new copy of the ``(out, in)`` matrix ``weight`` in ``dtype`` and oneDNN's packed form (uncached)."""
    with torch.inference_mode(False), torch.no_grad():
        # 8: the row count oneDNN blocks for (a decode step); a step of any row count can use the copy
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), 8)


def lone_row(x: torch.Tensor) -> bool:
    """True when ``x`` is one float32 row on a CPU: oneMKL's matrix-vector product for it rounds unlike
    its matrix product of two or more rows (which round alike at any row count for small matrices, and for
    any under ``MKL_CBWR=AUTO,STRICT``: greedy reproducibility in docs/serving.md)."""
    return x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu"


def twice(x: torch.Tensor) -> torch.Tensor:
    """(2, K) from a (1, K) row: a product over it rounds like any batch's, the second row is dropped."""
    return torch.cat([x, x])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a plain or a packed (:func:`packed_copy`) ``weight``.

    A packed matrix computes in its own dtype: ``x`` and ``bias`` are cast to it, as autocast would. A
    lone float32 row on a CPU is computed as two (:func:`lone_row`): a row's product is then the same
    whatever else its batch holds, which greedy reproducibility needs (docs/serving.md).
    """
    if not weight.is_mkldnn:
        if lone_row(x):
            return F.linear(twice(x), weight, bias)[:1]
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.to(weight.dtype)
    return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, b, "none", [], "")
