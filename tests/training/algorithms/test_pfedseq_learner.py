"""pFedSeq's sequence learners: the selective scan against a scalar recurrence, the Mamba block, the
scan backends, the learners' outputs and proxy updates (paper 003; the protocol and runs are
in test_pfedseq.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from training.algorithms.pfedseq import ssm
from training.algorithms.pfedseq.history import accumulate_proxy_grad, calibrate, learner_step
from training.algorithms.pfedseq.learners import make_learner


def _scan_reference(u, delta, A, B, C, D, z, delta_bias):
    """h_j = exp(dt_j A) h_{j-1} + dt_j B_j u_j; y_j = C_j . h_j + D u_j; y_j *= silu(z_j), one scalar at a time."""
    b, d, steps = u.shape
    n = A.shape[1]
    out = torch.zeros(b, d, steps, dtype=torch.float64)
    for i in range(b):
        for c in range(d):
            h = [0.0] * n
            for j in range(steps):
                dt = math.log1p(math.exp(float(delta[i, c, j] + delta_bias[c])))  # softplus
                h = [math.exp(dt * float(A[c, s])) * h[s] + dt * float(B[i, s, j]) * float(u[i, c, j])
                     for s in range(n)]
                y = sum(float(C[i, s, j]) * h[s] for s in range(n)) + float(D[c]) * float(u[i, c, j])
                zz = float(z[i, c, j])
                out[i, c, j] = y * zz / (1.0 + math.exp(-zz))
    return out


def test_selective_scan_equals_the_step_by_step_recurrence() -> None:
    g = torch.Generator().manual_seed(0)
    b, d, n, steps = 2, 3, 4, 5
    u, delta, z = (torch.randn(b, d, steps, generator=g) for _ in range(3))
    A = -torch.rand(d, n, generator=g) * 2
    B, C = torch.randn(b, n, steps, generator=g), torch.randn(b, n, steps, generator=g)
    D, bias = torch.randn(d, generator=g), torch.randn(d, generator=g)
    y = ssm.selective_scan(u, delta, A, B, C, D, z=z, delta_bias=bias, delta_softplus=True)
    ref = _scan_reference(u, delta, A, B, C, D, z, bias)
    assert y.shape == (b, d, steps)
    assert torch.allclose(y.double(), ref, atol=1e-5)


def _scan_autograd(u, delta, A, B, C):
    """The same recurrence through plain autograd (float64), for the hand-written backward."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=u.dtype)
    ys = []
    for j in range(u.shape[-1]):
        h = torch.exp(delta[..., j, None] * A) * h + (delta[..., j] * u[..., j])[..., None] * B[:, None, :, j]
        ys.append((h * C[:, None, :, j]).sum(-1))
    return torch.stack(ys, -1)


def test_selective_scan_backward_equals_autograd_through_the_recurrence() -> None:
    g = torch.Generator().manual_seed(1)
    b, d, n, steps = 3, 4, 5, 6
    args = [torch.randn(b, d, steps, generator=g, dtype=torch.float64),
            torch.rand(b, d, steps, generator=g, dtype=torch.float64),
            -torch.rand(d, n, generator=g, dtype=torch.float64),
            torch.randn(b, n, steps, generator=g, dtype=torch.float64),
            torch.randn(b, n, steps, generator=g, dtype=torch.float64)]
    weight = torch.randn(b, d, steps, generator=g, dtype=torch.float64)
    grads = []
    for fn in (ssm.selective_scan, _scan_autograd):
        leaves = [a.clone().requires_grad_(True) for a in args]
        (fn(*leaves) * weight).sum().backward()
        grads.append([x.grad for x in leaves])
    for mine, ref in zip(*grads, strict=True):
        assert torch.allclose(mine, ref, atol=1e-10)


def test_mamba_block_is_causal_over_rounds() -> None:
    torch.manual_seed(0)
    block = ssm.MambaBlock(3, backend="torch")
    x = torch.randn(4, 6, 3)
    later = x.clone()
    later[:, 4:] += 1.0
    y, y2 = block(x), block(later)
    assert torch.allclose(y[:, :4], y2[:, :4], atol=1e-6) and not torch.allclose(y[:, 4:], y2[:, 4:])


@pytest.mark.parametrize(("importable", "cuda", "device", "expected"), [
    (True, True, "cuda", "kernel"), (True, True, "cpu", "torch"), (True, False, "cuda", "torch"),
    (False, True, "cuda", "torch"),
])
def test_scan_backend_takes_the_kernel_only_with_package_cuda_and_cuda_tensors(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, importable: bool, cuda: bool, device: str,
    expected: str,
) -> None:
    def never_called(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the decision test must not run a scan")

    monkeypatch.setattr(ssm, "_kernel", lambda: (never_called, "9.9") if importable else (None, "not installed"))
    monkeypatch.setattr(ssm, "cuda_available", lambda: cuda)
    monkeypatch.setattr(ssm, "_ANNOUNCED", set())
    with caplog.at_level(logging.INFO, logger="training.algorithms.pfedseq.ssm"):
        choice, _ = ssm.scan_backend(torch.device(device))
        ssm.scan_backend(torch.device(device))  # the same choice is logged once
    assert choice == expected
    assert (ssm.scan_fn(torch.device(device)) is never_called) == (expected == "kernel")
    lines = [r.getMessage() for r in caplog.records if "selective scan" in r.getMessage()]
    wanted = "mamba-ssm CUDA kernel" if expected == "kernel" else "pure PyTorch"
    assert len(lines) == 1 and wanted in lines[0]
    assert ssm.scan_backend(torch.device(device), "torch")[0] == "torch"
    if expected != "kernel":
        with pytest.raises(ValueError, match="'kernel' requested but unavailable"):
            ssm.scan_backend(torch.device(device), "kernel")
    with pytest.raises(ValueError, match="scan backend must be one of"):
        ssm.scan_backend(torch.device(device), "triton")


@pytest.mark.cuda
@pytest.mark.skipif(ssm.kernel_scan() is None, reason="needs mamba-ssm built for this GPU (../shared/gpu/mamba_ssm.sh)")
def test_mamba_ssm_kernel_matches_the_pure_pytorch_learner() -> None:
    torch.manual_seed(0)
    learner = make_learner("ssm", 8, 10, backend="torch").cuda()
    x = torch.randn(4096, 10, 8, device="cuda")
    reference = learner(x)
    for block in learner.stack.mixers:
        block.backend = "kernel"
    assert torch.allclose(learner(x), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["ssm", "lstm", "mlp"])
def test_learner_output_is_one_calibration_per_client_at_the_last_step(kind: str) -> None:
    torch.manual_seed(0)
    learner = make_learner(kind, 3, 4, backend="torch")
    for steps in (1, 4):
        assert learner(torch.randn(7, steps, 3)).shape == (7, 3)
    with pytest.raises(ValueError, match="expects"):
        learner(torch.randn(7, 2, 5))
    if kind == "mlp":
        with pytest.raises(ValueError, match="at most 4 steps"):
            learner(torch.randn(7, 5, 3))
    with pytest.raises(ValueError, match="unknown learner"):
        make_learner("gru", 3, 4)


@pytest.mark.parametrize("kind", ["ssm", "lstm", "mlp"])
def test_proxy_update_moves_the_calibration_along_the_clients_new_updates(kind: str) -> None:
    torch.manual_seed(1)
    n, d = 3, 64
    window = [torch.randn(n, d) * 1e-3 for _ in range(3)]
    updates = torch.randn(n, d) * 1e-3
    learner = make_learner(kind, n, 4, backend="torch")
    before = calibrate(learner, window, 0, d, chunk=16)
    opt = torch.optim.Adam(learner.parameters(), lr=1e-4)
    learner_step([learner], [("all", 0, d)], window, updates, opt, chunk=16)
    after = calibrate(learner, window, 0, d, chunk=16)
    assert float(((after - before) * updates).sum()) > 0  # xi moved toward Delta (pFedHN's sign)
    assert float(((after - before) * -updates).sum()) < 0


@pytest.mark.parametrize("kind", ["ssm", "mlp"])
def test_chunked_and_unchunked_learner_passes_are_equal(kind: str) -> None:
    n, d = 3, 50
    window = [torch.randn(n, d) for _ in range(4)]
    updates = torch.randn(n, d)
    grads, outs = [], []
    for chunk in (d, 7):
        torch.manual_seed(2)
        learner = make_learner(kind, n, 4, backend="torch")
        accumulate_proxy_grad(learner, window, updates, 0, d, chunk)
        grads.append([p.grad.clone() for p in learner.parameters()])
        outs.append(calibrate(learner, window, 0, d, chunk))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads, strict=True))


def test_mamba_block_conv_taps_equal_torch_conv1d() -> None:
    torch.manual_seed(3)
    block = ssm.MambaBlock(5, backend="torch")
    u = torch.randn(4, block.conv1d.in_channels, 7)
    assert torch.allclose(block._causal_conv(u), block.conv1d(u)[..., :7], atol=1e-6)
