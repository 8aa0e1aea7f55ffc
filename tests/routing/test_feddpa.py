"""FedDPARouter: the paper's a = lambda * mean cosine, sampling modes, clipping, variants, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing import EmbeddingIndex, FedDPARouter, RoutingError


def vectors(n: int = 50, h: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, h)).astype(np.float32) + 0.5


def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)) @ (b / np.linalg.norm(b))


X, Q = vectors(), vectors(1, seed=1)[0]


@pytest.mark.parametrize("use_faiss", [True, False])
def test_knn_mean_cosine_matches_numpy_reference(use_faiss: bool) -> None:
    index = EmbeddingIndex(X, use_faiss=use_faiss)
    d = FedDPARouter(lambda_=0.7, S=5, mode="knn").decide(torch.from_numpy(Q), index)
    ref = np.sort(cos(X, Q))[::-1][:5]
    assert d.info["mean_similarity"] == pytest.approx(ref.mean(), abs=1e-6)
    assert d.info["a"] == pytest.approx(0.7 * ref.mean(), abs=1e-6)
    assert d.info["mode"] == "knn" and d.info["S"] == 5 and d.info["lambda"] == 0.7


def test_random_mode_uses_the_generators_sample() -> None:
    index = EmbeddingIndex(X)
    d = FedDPARouter(lambda_=1.0, S=5, mode="random").decide(Q, index, np.random.default_rng(3))
    picked = np.random.default_rng(3).choice(len(X), size=5, replace=False)
    assert d.info["mean_similarity"] == pytest.approx(cos(X[picked], Q).mean(), abs=1e-6)


def test_random_mode_is_reproducible_by_seed_and_fresh_per_request() -> None:
    index = EmbeddingIndex(X)

    def run(seed: int) -> list[float]:
        router = FedDPARouter(S=3, mode="random", seed=seed)
        return [router.decide(Q, index).info["a"] for _ in range(4)]

    assert run(11) == run(11)
    assert run(11) != run(12)
    assert len(set(run(11))) > 1  # a fresh sample per request


def test_weights_sum_to_one_and_local_gets_a() -> None:
    d = FedDPARouter(lambda_=0.5, S=4, mode="knn").decide(Q, EmbeddingIndex(X))
    a = d.info["a"]
    assert d.names == ("global", "client:local") and 0 < a < 1
    torch.testing.assert_close(d.weights, torch.tensor([1 - a, a], dtype=torch.float64))
    assert float(d.weights.sum()) == pytest.approx(1.0)
    ref = FedDPARouter(lambda_=0.5, S=4, mode="knn", variant="reference").decide(Q, EmbeddingIndex(X))
    # the reference code gives a to the global adapter
    torch.testing.assert_close(ref.weights, torch.tensor([a, 1 - a], dtype=torch.float64))
    assert ref.info["variant"] == "reference"


def test_clipping_to_unit_interval() -> None:
    index = EmbeddingIndex(np.stack([np.ones(4), np.ones(4) * 2]))
    opposite = -np.ones(4)
    low = FedDPARouter(S=2, mode="knn").decide(opposite, index)
    assert low.info["a"] == 0.0 and low.info["mean_similarity"] == pytest.approx(-1.0)
    torch.testing.assert_close(low.weights, torch.tensor([1.0, 0.0], dtype=torch.float64))
    high = FedDPARouter(lambda_=3.0, S=2, mode="knn").decide(np.ones(4), index)
    assert high.info["a"] == 1.0
    raw = FedDPARouter(S=2, mode="knn", clip=False).decide(opposite, index)
    assert raw.info["a"] == pytest.approx(-1.0)
    torch.testing.assert_close(raw.weights, torch.tensor([2.0, -1.0], dtype=torch.float64))


def test_s_larger_than_index_uses_all_with_a_note() -> None:
    d = FedDPARouter(S=10, mode="random", seed=0).decide(Q, EmbeddingIndex(X[:3]))
    assert d.info["S"] == 3 and d.info["S_requested"] == 10 and "used all 3" in d.info["note"]
    assert d.info["mean_similarity"] == pytest.approx(cos(X[:3], Q).mean(), abs=1e-6)


def test_a_decision_names_the_served_adapters_of_its_client() -> None:
    d = FedDPARouter(S=2, mode="knn").decide(torch.from_numpy(Q).unsqueeze(0), EmbeddingIndex(X), client="alice")
    assert d.names == ("global", "alice:local")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lambda_": -0.1}, "lambda_"),
        ({"lambda_": float("nan")}, "lambda_"),
        ({"S": 0}, "S "),
        ({"S": 2.5}, "S "),
        ({"mode": "nearest"}, "mode"),
        ({"variant": "code"}, "variant"),
    ],
)
def test_validation_errors_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(RoutingError, match=message):
        FedDPARouter(**kwargs)  # type: ignore[arg-type]


def test_representation_errors() -> None:
    router, index = FedDPARouter(mode="knn"), EmbeddingIndex(X)
    with pytest.raises(RoutingError, match="H=12"):
        router.decide(np.ones(5), index)
    with pytest.raises(RoutingError, match=r"\(H,\) or \(1, H\)"):
        router.decide(np.ones((2, 12)), index)
    with pytest.raises(RoutingError, match="NaN"):
        router.decide(np.full(12, np.nan), index)


@pytest.mark.parametrize("kind", ["neg_l2", "pearson"])
def test_similarity_ablations_match_naive_formulas(kind: str) -> None:
    """Paper 000 Table 9: -L2 and Pearson instead of the cosine, on the same sampled instances."""
    index = EmbeddingIndex(X)
    d = FedDPARouter(lambda_=0.5, S=5, mode="random", clip=False, similarity=kind).decide(
        Q, index, np.random.default_rng(4))
    picked = np.random.default_rng(4).choice(len(X), size=5, replace=False)
    if kind == "neg_l2":
        ref = [-float(np.sqrt(((X[i].astype(np.float64) - Q) ** 2).sum())) for i in picked]
    else:
        ref = [float(np.corrcoef(X[i].astype(np.float64), Q.astype(np.float64))[0, 1]) for i in picked]
    assert d.info["mean_similarity"] == pytest.approx(np.mean(ref), rel=1e-6)
    assert d.info["a"] == pytest.approx(0.5 * np.mean(ref), rel=1e-6) and d.info["similarity"] == kind
    knn = FedDPARouter(lambda_=1.0, S=3, mode="knn", similarity=kind).decide(Q, index)
    assert 0.0 <= knn.info["a"] <= 1.0
    with pytest.raises(RoutingError, match="similarity"):
        FedDPARouter(similarity="dot")  # type: ignore[arg-type]


def test_default_rule_follows_the_ablation_and_calibrated_refuses_it() -> None:
    from routing.feddpa import resolve_weighting, similarity_name

    assert resolve_weighting(None) == "calibrated"
    assert resolve_weighting(None, "pearson") == resolve_weighting(None, variant="reference") == "paper"
    assert resolve_weighting("paper", "neg_l2", "reference") == "paper"
    with pytest.raises(RoutingError, match="not similarity 'pearson' and variant 'reference'"):
        resolve_weighting("calibrated", "pearson", "reference")
    assert similarity_name("neg-l2") == similarity_name("NEG_L2") == "neg_l2"
    with pytest.raises(RoutingError, match="neg-l2"):
        similarity_name("euclid")


def test_an_index_pooled_otherwise_is_refused_not_compared() -> None:
    mean = EmbeddingIndex(X, pooling="mean")
    assert FedDPARouter(embedding="mean", mode="knn").decide(Q, mean).info["embedding"] == "mean"
    with pytest.raises(RoutingError, match="holds 'mean' embeddings.*--feddpa-embedding last"):
        FedDPARouter(mode="knn").decide(Q, mean, client="c")
    with pytest.raises(RoutingError, match="holds 'last' embeddings"):
        FedDPARouter(embedding="mean", mode="knn").decide(Q, EmbeddingIndex(X))
