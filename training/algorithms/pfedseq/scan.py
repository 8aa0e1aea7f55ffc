"""The selective scan of Mamba (Gu & Dao 2023, Algorithm 2) in pure PyTorch, with a hand-written backward.

``h_j = exp(delta_j A) h_{j-1} + delta_j B_j u_j``, ``y_j = C_j . h_j (+ D u_j) (* silu(z_j))``, the
semantics and argument layout of ``mamba_ssm``'s ``selective_scan_fn`` (paper 003, Appendix A).

Why a custom autograd function: autograd through a Python loop over the steps keeps every per-step
``[b, d, l, n]`` product and zero-fills a full-size gradient for every indexed step, which made
pFedSeq's server round at the SmolLM2 adapter size take minutes on a CPU. Here the forward keeps only
the states and decays (one ``[l, b, d, n]`` tensor each), and the backward is the reverse recurrence
``g_j = C_j dy_j + exp(delta_{j+1} A) g_{j+1}`` with every reduction as a batched matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _Scan(torch.autograd.Function):
    """``y[j] = C[j] . h[j]`` with ``h[j] = exp(delta[j] A) h[j-1] + (delta[j] u[j]) B[j]``, steps first.

    Shapes: u, delta ``[l, b, d]``; A ``[d, n]``; B, C ``[l, b, n]``; returns y ``[l, b, d]``.
    """

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor) -> torch.Tensor:
        steps, b, d = u.shape
        n = A.shape[1]
        states = u.new_empty(steps, b, d, n)
        decays = u.new_empty(steps, b, d, n)
        y = u.new_empty(steps, b, d)
        du = delta * u  # [l, b, d]
        h = u.new_zeros(b, d, n)
        for j in range(steps):
            torch.mul(delta[j].unsqueeze(-1), A, out=decays[j]).exp_()
            # outer products broadcast (a K=1 bmm is far slower on CPU)
            h = torch.addcmul(du[j].unsqueeze(-1) * B[j].unsqueeze(1), decays[j], h, out=states[j])
            torch.bmm(h, C[j].unsqueeze(-1), out=y[j].unsqueeze(-1))  # [b, d, 1]
        ctx.save_for_backward(u, delta, A, B, C, states, decays)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        u, delta, A, B, C, states, decays = ctx.saved_tensors
        steps, b, d = u.shape
        gy = gy.contiguous()
        g_du, g_delta, g_B, g_C = torch.empty_like(u), torch.zeros_like(delta), torch.empty_like(B), torch.empty_like(C)
        g_A = torch.zeros_like(A)
        du = delta * u
        g = u.new_zeros(b, d, A.shape[1])  # dL/dh_j, carried backwards
        for j in reversed(range(steps)):
            g.addcmul_(gy[j].unsqueeze(-1), C[j].unsqueeze(1))  # + dy_j outer C_j
            torch.bmm(gy[j].unsqueeze(1), states[j], out=g_C[j].unsqueeze(1))  # [b, 1, n]
            torch.bmm(g, B[j].unsqueeze(-1), out=g_du[j].unsqueeze(-1))  # [b, d, 1]
            torch.bmm(du[j].unsqueeze(1), g, out=g_B[j].unsqueeze(1))  # [b, 1, n]
            if j > 0:  # h_0 = 0: the first decay multiplies nothing
                t = g * states[j - 1] * decays[j]  # dL/d(delta_j A) elementwise, [b, d, n]
                g_delta[j] = (t * A).sum(-1)
                g_A += torch.einsum("bd,bdn->dn", delta[j], t)
            g = g * decays[j]
        g_delta += g_du * u
        return g_du * delta, g_delta, g_A, g_B, g_C


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   delta_bias: torch.Tensor | None = None, delta_softplus: bool = False) -> torch.Tensor:
    """The selective scan (the semantics of ``mamba_ssm``'s ``selective_scan_fn``).

    Args:
        u: inputs, ``[b, d, l]``.
        delta: step sizes before bias and softplus, ``[b, d, l]``.
        A: state matrix (diagonal per channel), ``[d, n]``.
        B: input-dependent input matrix, ``[b, n, l]``.
        C: input-dependent output matrix, ``[b, n, l]``.
        D: skip weight, ``[d]``.
        z: gate, ``[b, d, l]``; the output is multiplied by ``silu(z)``.
        delta_bias: added to ``delta``, ``[d]``.
        delta_softplus: apply softplus to ``delta`` (after the bias).

    Returns:
        ``[b, d, l]`` in ``u``'s dtype (computed in float32, or float64 for float64 inputs).
    """
    dtype = u.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u, delta = u.to(work), delta.to(work)
    if delta_bias is not None:
        delta = delta + delta_bias.to(work)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    steps_first = (u.permute(2, 0, 1).contiguous(), delta.permute(2, 0, 1).contiguous(), A.to(work).contiguous(),
                   B.to(work).permute(2, 0, 1).contiguous(), C.to(work).permute(2, 0, 1).contiguous())
    y = _Scan.apply(*steps_first).permute(1, 2, 0)  # [l, b, d] -> [b, d, l]
    if D is not None:
        y = y + u * D.to(work)[:, None]
    if z is not None:
        y = y * F.silu(z.to(work))
    return y.to(dtype)
