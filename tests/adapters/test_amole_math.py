"""AMoLE math against a naive per-token loop: gate, routed sum, shared expert, balance, grads."""

from __future__ import annotations

import math

import pytest
import torch

from adapters.amole import (
    amole_delta,
    amole_delta_dense,
    amole_forward,
    amole_gate,
    load_balance_loss,
)


def naive_amole_forward(
    h: torch.Tensor,
    base_out: torch.Tensor,
    shared_A: torch.Tensor | None,
    shared_B: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    P: torch.Tensor,
    scaling: float,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations (4)-(11) one token at a time; returns (out flattened, gates, topk idx)."""
    d = h.shape[-1]
    hf = h.reshape(-1, d)
    out = base_out.reshape(hf.shape[0], -1).clone()
    E, r, _ = A.shape
    k = min(top_k, E)
    gates, idxs = [], []
    for n in range(hf.shape[0]):
        x = hf[n]
        t = P @ x
        z = torch.stack([(A[j] @ x) @ t / math.sqrt(r) for j in range(E)])
        g = torch.softmax(z, dim=0)
        top_p, top_i = g.topk(k)
        w = top_p / top_p.sum()
        if shared_A is not None:
            out[n] = out[n] + scaling * shared_B @ (shared_A @ x)
        for slot in range(k):
            j = int(top_i[slot])
            out[n] = out[n] + w[slot] * scaling * B[j] @ (A[j] @ x)
        gates.append(g)
        idxs.append(top_i)
    return out, torch.stack(gates), torch.stack(idxs)


def make(E: int, d: int = 12, o: int = 10, r: int = 4, seed: int = 0, shared: bool = True):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(E, r, d, generator=g)
    B = torch.randn(E, o, r, generator=g)
    P = torch.randn(r, d, generator=g)
    sA = torch.randn(r, d, generator=g) if shared else None
    sB = torch.randn(o, r, generator=g) if shared else None
    return A, B, P, sA, sB


@pytest.mark.parametrize("E,top_k", [(1, 1), (1, 2), (2, 2), (3, 5), (5, 2), (6, 3), (8, 1)])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("batched", [False, True])
def test_forward_matches_naive(E: int, top_k: int, shared: bool, batched: bool) -> None:
    g = torch.Generator().manual_seed(E * 10 + top_k)
    A, B, P, sA, sB = make(E, shared=shared, seed=E + top_k)
    shape = (3, 7) if batched else (21,)
    h = torch.randn(*shape, 12, generator=g)
    base = torch.randn(*shape, 10, generator=g)
    res = amole_forward(h, base, sA, sB, A, B, P, scaling=2.0, top_k=top_k)
    ref, gates, idx = naive_amole_forward(h, base, sA, sB, A, B, P, 2.0, top_k)
    assert res.out.shape == base.shape
    assert res.topk_idx.shape == (21, min(top_k, E))
    torch.testing.assert_close(res.out.reshape(21, -1), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res.gates_full, gates, rtol=1e-5, atol=1e-6)
    assert torch.equal(res.topk_idx, idx)
    torch.testing.assert_close(res.topk_w.sum(-1), torch.ones(21))
    # The grouped path (taken under dropout) gives the same routed sum as the dense one.
    hf = h.reshape(21, 12)
    _, idx_g, w_g = amole_gate(hf, P, A, top_k)
    grouped = amole_delta(hf, A, B, 2.0, idx_g, w_g)
    if shared:
        grouped = grouped + 2.0 * hf @ sA.T @ sB.T
    torch.testing.assert_close(grouped + base.reshape(21, -1), ref, rtol=1e-4, atol=1e-4)


def test_dense_equals_grouped_at_smollm2_sizes() -> None:
    g = torch.Generator().manual_seed(5)
    A, B = torch.randn(6, 8, 576, generator=g) / 24, torch.randn(6, 576, 8, generator=g)
    P, h = torch.randn(8, 576, generator=g) / 24, torch.randn(256, 576, generator=g)
    _, idx, w = amole_gate(h, P, A, 2)
    emb = torch.einsum("erd,nd->ner", A, h)
    torch.testing.assert_close(
        amole_delta_dense(emb, B, 2.0, idx, w), amole_delta(h, A, B, 2.0, idx, w),
        rtol=1e-4, atol=1e-4,
    )


def test_random_sizes_match_naive() -> None:
    g = torch.Generator().manual_seed(123)
    for trial in range(5):
        E, k, d, o, r, n = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                            [(1, 9), (1, 4), (3, 20), (2, 15), (1, 9), (1, 40)])
        A, B, P, sA, sB = make(E, d=d, o=o, r=r, seed=trial, shared=trial % 2 == 0)
        h, base = torch.randn(n, d, generator=g), torch.randn(n, o, generator=g)
        res = amole_forward(h, base, sA, sB, A, B, P, scaling=0.5, top_k=k)
        ref, _, _ = naive_amole_forward(h, base, sA, sB, A, B, P, 0.5, k)
        torch.testing.assert_close(res.out, ref, rtol=1e-4, atol=1e-4)


def test_one_expert_is_shared_plus_that_expert() -> None:
    A, B, P, sA, sB = make(1)
    h = torch.randn(9, 12)
    gates, idx, w = amole_gate(h, P, A, top_k=2)
    assert torch.equal(w, torch.ones(9, 1)) and torch.equal(gates, torch.ones(9, 1))
    assert torch.equal(idx, torch.zeros(9, 1, dtype=torch.long))
    res = amole_forward(h, torch.zeros(9, 10), sA, sB, A, B, P, scaling=2.0, top_k=2)
    expected = 2.0 * (h @ sA.T @ sB.T + h @ A[0].T @ B[0].T)
    torch.testing.assert_close(res.out, expected, rtol=1e-5, atol=1e-5)


def test_delta_uses_only_selected_experts() -> None:
    A, B, _, _, _ = make(4)
    h = torch.randn(5, 12)
    idx = torch.tensor([[2], [2], [0], [3], [2]])
    w = torch.full((5, 1), 0.5)
    out = amole_delta(h, A, B, 3.0, idx, w)
    expected = torch.stack([1.5 * B[j] @ A[j] @ h[n] for n, j in enumerate(idx[:, 0].tolist())])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_dropout_only_on_lora_path() -> None:
    A, B, P, sA, sB = make(4)
    h, base = torch.randn(30, 12), torch.zeros(30, 10)
    clean = amole_forward(h, base, sA, sB, A, B, P, 2.0, 2)
    torch.manual_seed(0)
    dropped = amole_forward(h, base, sA, sB, A, B, P, 2.0, 2, dropout_p=0.5, training=True)
    assert torch.equal(dropped.gates_full, clean.gates_full)
    assert torch.equal(dropped.topk_idx, clean.topk_idx)
    assert not torch.allclose(dropped.out, clean.out)
    evaluated = amole_forward(h, base, sA, sB, A, B, P, 2.0, 2, dropout_p=0.5, training=False)
    torch.testing.assert_close(evaluated.out, clean.out)


def test_both_dropout_modes_keep_the_gate_and_are_unbiased() -> None:
    A, B, P, sA, sB = make(4)
    h, base = torch.randn(30, 12), torch.zeros(30, 10)
    clean = amole_forward(h, base, sA, sB, A, B, P, 2.0, 2)
    torch.manual_seed(1)
    tok = amole_forward(h, base, sA, sB, A, B, P, 2.0, 2, 0.5, True, routed_dropout="per_token")
    assert torch.equal(tok.topk_idx, clean.topk_idx)
    assert not torch.allclose(tok.out, clean.out)
    # p -> 0 leaves the per-token path exact.
    tiny = amole_forward(h, base, sA, sB, A, B, P, 2.0, 2, 1e-12, True, routed_dropout="per_token")
    torch.testing.assert_close(tiny.out, clean.out)
    torch.manual_seed(2)
    for mode in ("per_expert", "per_token"):
        draws = torch.stack([
            amole_forward(h[:4], base[:4], sA, sB, A, B, P, 2.0, 2, 0.3, True,
                          routed_dropout=mode).out  # type: ignore[arg-type]
            for _ in range(3000)
        ])
        scale = clean.out[:4].abs().mean()
        assert (draws.mean(0) - clean.out[:4]).abs().max() < 0.1 * scale
    with pytest.raises(ValueError, match="routed_dropout"):
        amole_forward(h, base, sA, sB, A, B, P, 2.0, 2, routed_dropout="none")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dropout", [(0.0, "per_expert"), (0.1, "per_expert"), (0.1, "per_token")]
)
def test_gradients_reach_every_parameter(dropout: tuple[float, str]) -> None:
    A, B, P, sA, sB = make(5)
    params = [A, B, P, sA, sB]
    for p in params:
        p.requires_grad_(True)
    h = torch.randn(2, 8, 12)
    res = amole_forward(
        h, torch.zeros(2, 8, 10), sA, sB, A, B, P, 2.0, 2,
        dropout_p=dropout[0], training=True, routed_dropout=dropout[1],  # type: ignore[arg-type]
    )
    loss = res.out.pow(2).sum() + load_balance_loss(res.gates_full, res.topk_idx)
    loss.backward()
    for p in params:
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_dense_and_grouped_gradients_agree() -> None:
    grads = []
    for path in ("dense", "grouped"):
        A, B, P, sA, sB = make(5)
        for p in (A, B, P):
            p.requires_grad_(True)
        h = torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
        gates, idx, w = amole_gate(h, P, A, 2)
        if path == "grouped":
            y = amole_delta(h, A, B, 2.0, idx, w)
        else:
            y = amole_delta_dense(torch.einsum("erd,nd->ner", A, h), B, 2.0, idx, w)
        (y.pow(2).sum() + load_balance_loss(gates, idx)).backward()
        grads.append([A.grad, B.grad, P.grad])
    for g_dense, g_grouped in zip(*grads, strict=True):
        torch.testing.assert_close(g_dense, g_grouped, rtol=1e-4, atol=1e-4)


def test_balance_loss_gradient_reaches_router() -> None:
    A, _, P, _, _ = make(4)
    A.requires_grad_(True)
    P.requires_grad_(True)
    gates, idx, _ = amole_gate(torch.randn(16, 12), P, A, 2)
    load_balance_loss(gates, idx).backward()
    assert P.grad is not None and P.grad.abs().sum() > 0
    assert A.grad is not None and A.grad.abs().sum() > 0


def test_balance_loss_is_one_when_balanced_and_larger_when_collapsed() -> None:
    E, k = 4, 2
    base = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # Token t prefers experts t, t+1 (mod E): mean probs and selection shares are both uniform.
    gates = torch.stack([base.roll(t) for t in range(E)] * 3)  # (12, E)
    idx = gates.topk(k, dim=-1).indices
    assert torch.bincount(idx.reshape(-1), minlength=E).tolist() == [6, 6, 6, 6]
    torch.testing.assert_close(load_balance_loss(gates, idx), torch.tensor(1.0))
    collapsed = base.expand(12, E)
    loss = load_balance_loss(collapsed, collapsed.topk(k, dim=-1).indices)
    torch.testing.assert_close(loss, torch.tensor(E * (0.4 + 0.3) / 2))
    assert loss > 1.0


def test_balance_loss_mask_drops_padding() -> None:
    gates = torch.softmax(torch.randn(10, 3), -1)
    idx = gates.topk(2, -1).indices
    mask = torch.tensor([True] * 6 + [False] * 4)
    torch.testing.assert_close(
        load_balance_loss(gates, idx, mask), load_balance_loss(gates[:6], idx[:6])
    )


def test_refuses_bad_inputs() -> None:
    A, B, P, sA, _ = make(2)
    h = torch.randn(3, 12)
    with pytest.raises(ValueError, match="E = 0"):
        amole_gate(h, P, A[:0], 2)
    with pytest.raises(ValueError, match="E = 0"):
        amole_forward(h, torch.zeros(3, 10), None, None, A[:0], B[:0], P, 2.0, 2)
    with pytest.raises(ValueError, match="top_k"):
        amole_gate(h, P, A, 0)
    with pytest.raises(ValueError, match="both"):
        amole_forward(h, torch.zeros(3, 10), sA, None, A, B, P, 2.0, 2)


def naive_vanilla_forward(h: torch.Tensor, base_out: torch.Tensor, A: torch.Tensor, B: torch.Tensor, W: torch.Tensor,
                          scaling: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FedAMoLE-A's vanilla MoLE module one token at a time: logits W_j . h, softmax, top-k, renormalised."""
    hf = h.reshape(-1, h.shape[-1])
    out = base_out.reshape(hf.shape[0], -1).clone()
    k = min(top_k, A.shape[0])
    idxs = []
    for n in range(hf.shape[0]):
        g = torch.softmax(W @ hf[n], dim=0)
        top_p, top_i = g.topk(k)
        for slot in range(k):
            j = int(top_i[slot])
            out[n] = out[n] + top_p[slot] / top_p.sum() * scaling * B[j] @ (A[j] @ hf[n])
        idxs.append(top_i)
    return out, torch.stack(idxs)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_vanilla_router_matches_naive(dropout: float) -> None:
    """Paper 002 s5.5 (FedAMoLE-A): the gate is a linear router over the assigned experts' rows; both
    routed-sum paths (dense, and grouped under per-expert dropout) give the naive result."""
    A, B, _, _, _ = make(5, shared=False, seed=3)
    W = torch.randn(5, 12, generator=torch.Generator().manual_seed(4))
    h = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(5))
    base = torch.randn(2, 6, 10, generator=torch.Generator().manual_seed(6))
    ref, idx = naive_vanilla_forward(h, base, A, B, W, 2.0, 2)
    res = amole_forward(h, base, None, None, A, B, W, 2.0, 2, router="vanilla")
    torch.testing.assert_close(res.out.reshape(12, -1), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(res.topk_idx, idx)
    torch.manual_seed(0)
    dropped = amole_forward(h, base, None, None, A, B, W, 2.0, 2, dropout_p=dropout, training=True, router="vanilla")
    assert torch.equal(dropped.topk_idx, idx)  # the gate sees the clean input
    if dropout == 0.0:
        torch.testing.assert_close(dropped.out.reshape(12, -1), ref, rtol=1e-4, atol=1e-4)
    amole_forward(h, base, None, None, A, B, torch.randn(4, 12), 2.0, 2)  # AMoLE: the same shape is P (r, d)
    with pytest.raises(ValueError, match="one row per assigned expert"):
        amole_forward(h, base, None, None, A, B, torch.randn(4, 12), 2.0, 2, router="vanilla")


@pytest.mark.parametrize("mode", ["per_expert", "per_token"])
def test_expert_dropout_draws_the_lora_dropout_masks_compiled_or_not(mode: str) -> None:
    """The experts' masks are :mod:`adapters.dropout`'s (one seed, the same masks eager and compiled, as the
    plain adapters'); before, ``F.dropout`` let a compiled layer draw its own."""
    A, B, P, sA, sB = make(4)
    h, base = torch.randn(30, 12), torch.zeros(30, 10)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return amole_forward(x, base, sA, sB, A, B, P, 2.0, 2, 0.5, True, routed_dropout=mode).out  # type: ignore[arg-type]

    torch.manual_seed(4)
    eager = fn(h)
    torch.manual_seed(4)
    compiled = torch.compile(fn, dynamic=True)(h)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
