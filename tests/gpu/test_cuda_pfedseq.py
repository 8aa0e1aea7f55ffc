"""On a CUDA GPU with mamba-ssm (``make test-gpu``): its selective-scan kernel equals pFedSeq's own scan.

mamba-ssm has no wheel on PyPI; build it for the GPU with ``../shared/gpu/mamba_ssm.sh`` (README, GPU)
into ``../shared/gpu/mamba-ssm``, which ``make test-gpu`` puts on ``PYTHONPATH`` (elsewhere: ``make test-gpu
MAMBA_SSM=TARGET``). Without it the kernel test is skipped with that reason. Measured on an
H100 (torch 2.11+cu130, mamba-ssm 2.3.2.post1): forward 1.8e-7, gradients 8.1e-7 relative. The whole
learner on the kernel is compared in tests/training/algorithms/test_pfedseq_learner.py (also marked ``cuda``).
"""

from __future__ import annotations

import pytest
import torch

from training.algorithms.pfedseq import ssm
from training.algorithms.pfedseq.scan import selective_scan

pytestmark = pytest.mark.cuda


def _kernel():
    fn, why = ssm._kernel()
    if fn is None:
        pytest.skip(f"needs mamba-ssm built for this GPU (../shared/gpu/mamba_ssm.sh build SDIST "
                    f"../shared/gpu/mamba-ssm, or make test-gpu MAMBA_SSM=TARGET): {why}")
    return fn


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_the_kernel_scan_equals_ours_forward_and_gradients() -> None:
    kernel = _kernel()
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, d, n, steps = 8, 256, 16, 20

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to("cuda").requires_grad_(True)

    u, delta, z = draw(b, d, steps), draw(b, d, steps, scale=0.5), draw(b, d, steps)
    A = (-torch.rand(d, n, generator=gen) - 0.1).to("cuda").requires_grad_(True)
    B, C, D, bias = draw(b, n, steps), draw(b, n, steps), draw(d), draw(d, scale=0.1)
    inputs = (u, delta, A, B, C, D, z, bias)
    weights = torch.randn(b, d, steps, generator=gen).to("cuda")  # a loss that weighs every output
    outs, grads = [], []
    for fn in (selective_scan, kernel):
        y = fn(u, delta, A, B, C, D, z=z, delta_bias=bias, delta_softplus=True)
        outs.append(y.detach())
        grads.append(torch.autograd.grad((y * weights).sum(), inputs))
    assert _relative(outs[1], outs[0]) < 1e-5
    for name, mine, theirs in zip(("u", "delta", "A", "B", "C", "D", "z", "delta_bias"), *grads, strict=True):
        assert _relative(theirs, mine) < 1e-4, name
