"""The selective SSM (Mamba block, Gu & Dao 2023) of pFedSeq's sequential learner, in pure PyTorch.

Paper 003, Appendix A / docs/methods.md 4.2: in_proj d_model -> 2E (E = expand * d_model), split (u, z);
u through a causal depthwise Conv1d over the steps (kernel 4) and SiLU; (delta, B, C) = x_proj(u), delta
of rank ceil(d_model / 16) lifted to E by dt_proj and passed through softplus; A = -exp(A_log) in R^{E x M};
h_j = exp(delta_j A) h_{j-1} + delta_j B_j u_j, y_j = C_j h_j + D u_j; y * SiLU(z); out_proj E -> d_model.

The pure-PyTorch scan (:mod:`training.algorithms.pfedseq.scan`) has the argument layout of ``mamba_ssm``'s
``selective_scan_fn``, so the CUDA kernel replaces it one for one: it is picked only when ``mamba_ssm``
imports, CUDA is available and the tensors are on a CUDA device (:func:`scan_backend`); the choice is
logged once. The pure-PyTorch scan loops over the steps, vectorised over batch, channels and state (the
learner's sequences are a few dozen rounds at most, so the paper's parallel scan buys little here).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from training.algorithms.pfedseq.scan import selective_scan

logger = logging.getLogger(__name__)

ScanFn = Callable[..., torch.Tensor]
__all__ = ["BACKENDS", "MambaBlock", "ResidualStack", "scan_backend", "scan_fn", "selective_scan"]
BACKENDS = ("auto", "torch", "kernel")


@lru_cache(maxsize=1)
def _kernel() -> tuple[ScanFn | None, str]:
    """``mamba_ssm``'s CUDA scan and its version, or None and why it cannot be used (imported once)."""
    try:
        import mamba_ssm
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as exc:  # a broken CUDA build raises OSError/RuntimeError, not only ImportError
        return None, f"mamba_ssm not importable ({type(exc).__name__}: {exc})"
    return selective_scan_fn, str(getattr(mamba_ssm, "__version__", "?"))


def kernel_scan() -> ScanFn | None:
    """``mamba_ssm``'s ``selective_scan_fn`` when the package imports, else None."""
    return _kernel()[0]


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (a seam for the decision test)."""
    return torch.cuda.is_available()


_ANNOUNCED: set[str] = set()


def scan_backend(device: torch.device, requested: str = "auto") -> tuple[str, str]:
    """Which scan runs on ``device``: ``("kernel" | "torch", reason)``; logs each distinct choice once.

    ``auto`` takes the kernel only when ``mamba_ssm`` imports AND CUDA is available AND ``device`` is a
    CUDA device; ``torch`` always takes the pure-PyTorch scan; ``kernel`` insists on the kernel.

    Raises:
        ValueError: ``requested`` is not a backend, or ``kernel`` was requested where it cannot run.
    """
    if requested not in BACKENDS:
        raise ValueError(f"scan backend must be one of {BACKENDS}, got {requested!r}")
    fn, info = _kernel()
    if requested == "torch":
        choice, reason = "torch", "requested"
    elif fn is None:
        choice, reason = "torch", info
    elif not cuda_available():
        choice, reason = "torch", "CUDA is not available"
    elif device.type != "cuda":
        choice, reason = "torch", f"the learner runs on {device.type}"
    else:
        choice, reason = "kernel", f"mamba_ssm {info} on {device}"
    if requested == "kernel" and choice != "kernel":
        raise ValueError(f"scan backend 'kernel' requested but unavailable: {reason}")
    line = ("pFedSeq selective scan: mamba-ssm CUDA kernel (" + reason + ")" if choice == "kernel"
            else "pFedSeq selective scan: pure PyTorch (" + reason + ")")
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        logger.info(line)
    return choice, reason


def scan_fn(device: torch.device, requested: str = "auto") -> ScanFn:
    """The scan function :func:`scan_backend` chooses for ``device``."""
    choice, _ = scan_backend(device, requested)
    fn = kernel_scan() if choice == "kernel" else None
    return fn if fn is not None else selective_scan


class MambaBlock(nn.Module):
    """One Mamba mixer: projections, causal depthwise conv, selective SSM, gate (Mamba's default init)."""

    def __init__(self, d_model: int, d_state: int = 16, expand: int = 2, d_conv: int = 4, backend: str = "auto",
                 dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        super().__init__()
        if min(d_model, d_state, expand, d_conv) < 1:
            raise ValueError(f"Mamba sizes must be >= 1, got d_model={d_model} d_state={d_state} "
                             f"expand={expand} d_conv={d_conv}")
        if backend not in BACKENDS:
            raise ValueError(f"scan backend must be one of {BACKENDS}, got {backend!r}")
        inner, self.dt_rank = expand * d_model, math.ceil(d_model / 16)
        self.d_state, self.backend = d_state, backend
        self.in_proj = nn.Linear(d_model, 2 * inner, bias=False)
        self.conv1d = nn.Conv1d(inner, inner, d_conv, groups=inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, inner)
        self.out_proj = nn.Linear(inner, d_model, bias=False)
        # dt starts log-uniform in [dt_min, dt_max]: the bias is softplus^-1 of it (Gu & Dao's init)
        nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
        dt = torch.exp(torch.rand(inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        # S4D-real init: A = -(1..M) for every channel, kept as log for a negative real A
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))

    def _causal_conv(self, u: torch.Tensor) -> torch.Tensor:
        """``conv1d``'s depthwise causal convolution (``[b, E, l]``) as k shifted products.

        Same parameters and result as ``self.conv1d`` with left padding; the explicit taps avoid the
        slow CPU depthwise-convolution backward on these tiny kernels.
        """
        k, steps = self.conv1d.kernel_size[0], u.shape[-1]
        padded = F.pad(u, (k - 1, 0))  # [b, E, l + k - 1]: zeros before the first round
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias  # [E, k], [E]
        assert bias is not None  # conv1d is built with its default bias
        out = bias[:, None] + padded[..., :steps] * weight[:, 0:1]
        for i in range(1, k):
            out = out + padded[..., i:i + steps] * weight[:, i:i + 1]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, l, d_model] -> [b, l, d_model]``, causal in ``l``."""
        u, z = self.in_proj(x).chunk(2, dim=-1)  # [b, l, E] each
        u = F.silu(self._causal_conv(u.transpose(1, 2)))  # [b, E, l]
        dt, B, C = self.x_proj(u.transpose(1, 2)).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = (dt @ self.dt_proj.weight.t()).transpose(1, 2)  # [b, E, l]; bias goes in as delta_bias
        scan = scan_fn(x.device, self.backend)
        y = scan(u.contiguous(), delta.contiguous(), -torch.exp(self.A_log.float()),
                 B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(), self.D.float(),
                 z=z.transpose(1, 2).contiguous(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        return self.out_proj(y.transpose(1, 2))  # [b, l, d_model]


class ResidualStack(nn.Module):
    """Pre-norm residual layers ``x <- x + mixer(RMSNorm(x))`` (Gu & Dao's block layout), no final norm.

    pFedSeq reads the last step of the residual stream as the calibration, so the output stays in the
    units of the input updates; a final norm (Mamba's LM head) would rescale it to unit RMS.
    """

    def __init__(self, mixers: list[nn.Module], d_model: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, eps=1e-5) for _ in mixers)
        self.mixers = nn.ModuleList(mixers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, l, d_model] -> [b, l, d_model]``."""
        for norm, mixer in zip(self.norms, self.mixers, strict=True):
            x = x + mixer(norm(x))
        return x
