"""RSEA: the MILP against brute force, feasibility errors, embeddings, aggregation, embedding noise."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import milp

from training.algorithms.fedamole.rsea import (
    AMoLEConfig,
    EmbeddingAccumulator,
    add_dp_noise,
    add_gaussian_noise,
    aggregate_experts,
    aggregate_token_proj,
    assign_experts,
    random_scores,
    relevance_scores,
    scores_source,
    selection_probabilities,
    server_expert_embeddings,
)
from training.algorithms.fedamole.rsea_milp import client_bounds, milp_constraints, solve_assignment


def brute_force(P: np.ndarray, k_c: int, lo: int, hi: int) -> float:
    n_e, n_c = P.shape
    best = -np.inf
    for bits in itertools.product((0, 1), repeat=n_e * n_c):
        X = np.array(bits).reshape(n_e, n_c)
        col = X.sum(0)
        if (X.sum(1) == k_c).all() and (col >= lo).all() and (col <= hi).all():
            best = max(best, float((P * X).sum()))
    return best


def check_constraints(X: np.ndarray, k_c: int, lo: int, hi: int) -> None:
    assert set(np.unique(X).tolist()) <= {0, 1}
    assert (X.sum(1) == k_c).all()
    assert (X.sum(0) >= lo).all() and (X.sum(0) <= hi).all()


@pytest.mark.parametrize("e_min,e_max", [(1, 2), (1, 3), (2, 2), (2, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_milp_matches_brute_force(e_min: int, e_max: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    P = rng.random((3, 3))
    X = solve_assignment(P, k_c=2, e_min=e_min, e_max=e_max)
    check_constraints(X, 2, e_min, e_max)
    assert float((P * X).sum()) == pytest.approx(brute_force(P, 2, e_min, e_max), abs=1e-9)


@pytest.mark.parametrize("shape,k_c", [((4, 3), 1), ((3, 4), 2), ((2, 5), 3)])
def test_milp_matches_brute_force_rectangular(shape: tuple[int, int], k_c: int) -> None:
    P = np.random.default_rng(7).random(shape)
    lo, hi = client_bounds(*shape, k_c, 0, 3)
    X = solve_assignment(P, k_c=k_c, e_min=0, e_max=3)
    check_constraints(X, k_c, lo, hi)
    assert float((P * X).sum()) == pytest.approx(brute_force(P, k_c, lo, hi), abs=1e-9)


def test_default_size_meets_every_constraint() -> None:
    P = selection_probabilities(random_scores(30, 10, torch.Generator().manual_seed(0))).numpy()
    X = solve_assignment(P)
    check_constraints(X, 2, 2, 8)
    assert X.dtype == np.int64


def test_homogeneous_gives_equal_loads() -> None:
    P = np.random.default_rng(3).random((6, 4))
    check_constraints(solve_assignment(P, k_c=2, homogeneous=True), 2, 3, 3)
    small = np.random.default_rng(4).random((4, 4))
    Xs = solve_assignment(small, k_c=2, homogeneous=True)
    check_constraints(Xs, 2, 2, 2)
    assert float((small * Xs).sum()) == pytest.approx(brute_force(small, 2, 2, 2), abs=1e-9)


@pytest.mark.parametrize(
    "shape,kwargs,numbers",
    [
        (
            (30, 5),
            dict(k_c=2, e_min=2, e_max=8),
            ["N_e*k_c = 60", "N_c = 5", "e_max = 8", "max 40"],
        ),
        ((3, 2), dict(k_c=3, e_min=0, e_max=3), ["k_c = 3", "N_c = 2"]),
        ((3, 4), dict(k_c=1, e_min=2, e_max=8), ["N_e*k_c = 3", "N_c = 4", "e_min = 2", "needs 8"]),
        ((3, 3), dict(k_c=2, e_min=3, e_max=2), ["e_min = 3", "e_max = 2"]),
        ((5, 3), dict(k_c=2, homogeneous=True), ["N_e*k_c = 10", "N_c = 3", "10/3"]),
    ],
)
def test_infeasible_settings_refused_up_front(shape, kwargs, numbers) -> None:
    with pytest.raises(ValueError) as err:
        solve_assignment(np.ones(shape), **kwargs)
    for text in numbers:
        assert text in str(err.value)


def test_lp_relaxation_is_integral() -> None:
    P = np.random.default_rng(5).random((30, 10))
    res = milp(-P.ravel(), constraints=milp_constraints(30, 10, 2, 2, 8), bounds=(0, 1))
    assert res.success
    assert np.abs(res.x - np.round(res.x)).max() < 1e-6
    X = solve_assignment(P)
    assert -res.fun == pytest.approx(float((P * X).sum()), abs=1e-9)


def test_scip_missing_is_named() -> None:
    if importlib.util.find_spec("pyscipopt") is not None:
        X = solve_assignment(np.random.default_rng(0).random((6, 3)), solver="scip")
        check_constraints(X, 2, 2, 6)
        return
    with pytest.raises(ImportError, match="pyscipopt"):
        solve_assignment(np.ones((4, 3)), solver="scip")


def test_config_validation() -> None:
    cfg = AMoLEConfig()
    cfg.check_clients(10)
    with pytest.raises(ValueError, match="max 40"):
        cfg.check_clients(5)
    with pytest.raises(ValueError):
        AMoLEConfig(min_experts=9)
    with pytest.raises(ValueError):
        AMoLEConfig(assignment="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AMoLEConfig(solver="gurobi")  # type: ignore[arg-type]
    assert scores_source(cfg, 0) == "random" and scores_source(cfg, 3) == "relevance"
    assert scores_source(AMoLEConfig(assignment="static"), 3) == "keep"
    assert scores_source(AMoLEConfig(assignment="random"), 3) == "random"


def test_assign_experts_whole_model() -> None:
    cfg = AMoLEConfig(num_experts=6, max_experts=4)
    clients = ["a", "b", "c"]
    modules = [f"layers.{i}.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    out = assign_experts(None, cfg, clients, modules, torch.Generator().manual_seed(1))
    again = assign_experts(None, cfg, clients, modules, torch.Generator().manual_seed(1))
    assert out == again and list(out) == modules
    for per_client in out.values():
        assert set(per_client) == set(clients)
        held = [j for ids in per_client.values() for j in ids]
        assert sorted(held) == sorted(list(range(6)) * 2)
        assert all(ids == sorted(ids) and 2 <= len(ids) <= 4 for ids in per_client.values())
    # Relevance scores that favour one client per expert are honoured where feasible.
    s = torch.full((6, 3), -5.0)
    for j in range(6):
        s[j, j % 3] = 5.0
        s[j, (j + 1) % 3] = 4.0
    got = assign_experts({"m": s}, cfg, clients)["m"]
    assert got == {"a": [0, 2, 3, 5], "b": [0, 1, 3, 4], "c": [1, 2, 4, 5]}


def test_random_scores_reproducible() -> None:
    a = random_scores(30, 10, torch.Generator().manual_seed(42))
    b = random_scores(30, 10, torch.Generator().manual_seed(42))
    c = random_scores(30, 10, torch.Generator().manual_seed(43))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0 <= float(a.min()) and float(a.max()) < 1
    rows = selection_probabilities(a).sum(1)
    torch.testing.assert_close(rows, torch.ones(30, dtype=torch.float64))


def test_accumulator_weights_by_token_count() -> None:
    g = torch.Generator().manual_seed(0)
    P, A = torch.randn(4, 12, generator=g), torch.randn(3, 4, 12, generator=g)
    batches = [torch.randn(1, n, 12, generator=g) for n in (5, 17, 2)]
    acc = EmbeddingAccumulator()
    for h in batches:
        acc.add(h, P, A)
    c, e = acc.result()
    allh = torch.cat([h.reshape(-1, 12) for h in batches])
    assert acc.num_tokens == 24
    torch.testing.assert_close(c, (allh @ P.T).mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e, torch.einsum("erd,nd->er", A, allh) / 24, rtol=1e-5, atol=1e-5)
    masked = EmbeddingAccumulator()
    masked.add(torch.cat([batches[0], torch.zeros(1, 3, 12)], 1), P, A,
               mask=torch.tensor([[True] * 5 + [False] * 3]))
    torch.testing.assert_close(masked.result()[0], (batches[0][0] @ P.T).mean(0))


def test_server_embeddings_and_relevance() -> None:
    per_client = {
        "a": {0: torch.tensor([1.0, 0.0]), 2: torch.tensor([0.0, 2.0])},
        "b": {0: torch.tensor([3.0, 0.0])},
    }
    e = server_expert_embeddings(per_client, num_experts=3)
    torch.testing.assert_close(e, torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 2.0]]))
    c = torch.tensor([[1.0, 1.0], [0.0, 4.0]])
    s = relevance_scores(e, c)
    torch.testing.assert_close(s, e @ c.T / 2**0.5)
    assert s.shape == (3, 2)


def test_aggregation_averages_over_holders() -> None:
    def ab(v: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2, 3), v), torch.full((4, 2), -v)

    per_client = {
        "a": {0: ab(1.0), 1: ab(10.0), "shared": ab(0.0)},
        "b": {0: ab(3.0), "shared": ab(3.0)},
        "c": {2: ab(5.0), "shared": ab(6.0)},
    }
    agg = aggregate_experts(per_client)
    assert set(agg) == {0, 1, 2, "shared"}
    assert agg[0][0].eq(2.0).all() and agg[0][1].eq(-2.0).all()
    assert agg[1][0].eq(10.0).all() and agg[2][0].eq(5.0).all()
    assert agg["shared"][0].eq(3.0).all()
    tp = aggregate_token_proj([torch.ones(2, 3), torch.zeros(2, 3), torch.full((2, 3), 5.0)])
    assert tp.eq(2.0).all()


def test_dp_noise_respects_the_clean_norm_bound() -> None:
    g = torch.Generator().manual_seed(0)
    P, A = torch.randn(8, 16, generator=g), torch.randn(5, 8, 16, generator=g)
    acc = EmbeddingAccumulator()
    for _ in range(3):
        acc.add(torch.randn(20, 16, generator=g), P, A)
    c, e = acc.result()
    tok_bound, exp_bound = acc.max_clean_norms
    rng = np.random.default_rng(0)
    for eta in (100.0, 1.0, 0.01):
        nc = add_dp_noise(c, eta, tok_bound, rng)
        ne = add_dp_noise(e, eta, exp_bound, rng)
        assert nc.shape == c.shape and ne.shape == e.shape
        assert float(nc.norm()) <= tok_bound * (1 + 1e-6)
        assert (ne.norm(dim=-1) <= exp_bound * (1 + 1e-6)).all()
        assert not torch.equal(nc, c)
    same = add_dp_noise(c, 100.0, tok_bound, np.random.default_rng(9))
    assert torch.equal(same, add_dp_noise(c, 100.0, tok_bound, np.random.default_rng(9)))
    # Gamma(dim, rate eta) magnitude: large eta means little noise.
    small = add_dp_noise(c, 1e6, 1e9, np.random.default_rng(1))
    torch.testing.assert_close(small, c, atol=1e-4, rtol=0)


def test_gaussian_noise_has_the_requested_scale() -> None:
    emb = torch.randn(30, 64, generator=torch.Generator().manual_seed(0))  # (E, r)
    sigma = 0.3
    noisy = add_gaussian_noise(emb, sigma, torch.Generator().manual_seed(5))
    diff = (noisy - emb).double()
    assert noisy.shape == emb.shape and noisy.dtype == emb.dtype
    assert abs(float(diff.mean())) < 4 * sigma / diff.numel() ** 0.5
    assert float(diff.std()) == pytest.approx(sigma, rel=0.05)  # 1920 draws: std within a few percent
    assert torch.equal(noisy, add_gaussian_noise(emb, sigma, torch.Generator().manual_seed(5)))
    assert not torch.equal(noisy, add_gaussian_noise(emb, sigma, torch.Generator().manual_seed(6)))
    assert add_gaussian_noise(emb, 0.0, torch.Generator()) is emb
    with pytest.raises(ValueError, match="sigma"):
        add_gaussian_noise(emb, -0.1, torch.Generator())
    with pytest.raises(ValueError, match="embed_noise"):
        AMoLEConfig(embed_noise=-1.0)
    with pytest.raises(ValueError, match="not both"):
        AMoLEConfig(embed_noise=0.1, dp_noise=True)
    with pytest.raises(ValueError, match="num_experts must be an integer"):
        AMoLEConfig(num_experts=2.5)  # type: ignore[arg-type]
