"""EmbeddingIndex (faiss and numpy paths), save/load, sampling, and IndexCache versions and isolation."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from routing import EmbeddingIndex, IndexCache, RoutingError, StoredRoutingError


def vectors(n: int = 40, h: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, h)).astype(np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture()
def no_faiss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError


@pytest.mark.parametrize("use_faiss", [True, False])
def test_search_returns_true_nearest_by_cosine(use_faiss: bool) -> None:
    x, q = vectors(), vectors(3, seed=1)
    index = EmbeddingIndex(x, use_faiss=use_faiss)
    assert index.uses_faiss is use_faiss
    sims, idx = index.search(q, 5)
    ref = unit(q) @ unit(x).T  # (3, N)
    np.testing.assert_array_equal(idx, np.argsort(-ref, axis=1)[:, :5])
    np.testing.assert_allclose(sims, np.take_along_axis(ref, idx, axis=1), atol=1e-5)
    assert index.search(q[0], 100)[1].shape == (1, 40)  # k cut to the index size


def test_faiss_and_numpy_paths_agree_and_fallback_is_automatic(monkeypatch: pytest.MonkeyPatch) -> None:
    x, q = vectors(300, 32), vectors(4, 32, seed=2)
    with_faiss = EmbeddingIndex(x).search(q, 7)
    monkeypatch.setitem(sys.modules, "faiss", None)
    fallback = EmbeddingIndex(x)
    assert not fallback.uses_faiss
    without = fallback.search(q, 7)
    np.testing.assert_array_equal(with_faiss[1], without[1])
    np.testing.assert_allclose(with_faiss[0], without[0], atol=1e-5)


def test_cosines_and_sample() -> None:
    x, q = vectors(), vectors(1, seed=3)[0]
    index = EmbeddingIndex(x)
    idx = index.sample(5, np.random.default_rng(7))
    assert len(set(idx.tolist())) == 5
    np.testing.assert_array_equal(idx, index.sample(5, np.random.default_rng(7)))
    assert not np.array_equal(idx, index.sample(5, np.random.default_rng(8)))
    np.testing.assert_allclose(index.cosines(q, idx), unit(x[idx]) @ unit(q), atol=1e-6)
    assert sorted(index.sample(99, np.random.default_rng(0)).tolist()) == list(range(40))


@pytest.mark.parametrize("use_faiss", [True, False])
def test_save_load_round_trip(tmp_path: Path, use_faiss: bool) -> None:
    x = vectors()
    EmbeddingIndex(x, use_faiss=use_faiss).save(tmp_path)
    assert (tmp_path / "embeddings.faiss").is_file() is use_faiss
    back = EmbeddingIndex.load(tmp_path, use_faiss=use_faiss)
    np.testing.assert_array_equal(back.raw, x)
    assert back.uses_faiss is use_faiss
    q = vectors(2, seed=5)
    np.testing.assert_array_equal(back.search(q, 3)[1], EmbeddingIndex(x).search(q, 3)[1])


def test_load_refuses_a_stale_faiss_file(tmp_path: Path) -> None:
    EmbeddingIndex(vectors(40)).save(tmp_path)
    np.save(tmp_path / "embeddings.npy", vectors(30))
    with pytest.raises(RoutingError, match="rebuild the index"):
        EmbeddingIndex.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EmbeddingIndex.load(tmp_path / "nowhere")


def test_index_validation_errors_name_the_problem() -> None:
    with pytest.raises(RoutingError, match="non-empty"):
        EmbeddingIndex(np.zeros((0, 4)))
    with pytest.raises(RoutingError, match="NaN"):
        EmbeddingIndex(np.full((2, 4), np.nan))
    index = EmbeddingIndex(vectors())
    with pytest.raises(RoutingError, match="H=16"):
        index.search(np.ones(8), 1)
    with pytest.raises(RoutingError, match="k must be"):
        index.search(np.ones(16), 0)
    with pytest.raises(RoutingError, match="S must be"):
        index.sample(0, np.random.default_rng())


def _write(root: Path, client: str, x: np.ndarray) -> None:
    EmbeddingIndex(x).save(root / client)


def test_cache_versions_reload_new_vectors(tmp_path: Path) -> None:
    _write(tmp_path, "alice", vectors(seed=1))
    cache = IndexCache(tmp_path)
    first = cache.get("alice", 1)
    assert cache.get("alice", 1) is first
    _write(tmp_path, "alice", vectors(seed=2))  # adapter reloaded: new files, version bumped
    assert cache.get("alice", 1) is first  # the old key still answers from memory...
    second = cache.get("alice", 2)
    np.testing.assert_array_equal(second.raw, vectors(seed=2))
    assert cache.keys() == [("alice", 2)]  # ...until a newer version drops it
    cache.invalidate("alice")
    assert len(cache) == 0


def test_cache_is_lru_by_count(tmp_path: Path, no_faiss: None) -> None:
    for c in ("a", "b", "c"):
        _write(tmp_path, c, vectors(seed=ord(c)))
    cache = IndexCache(tmp_path, capacity=2)
    cache.get("a")
    cache.get("b")
    cache.get("a")
    cache.get("c")
    assert cache.keys() == [("a", 0), ("c", 0)]
    assert not cache.get("a").uses_faiss


def test_cache_client_isolation(tmp_path: Path) -> None:
    _write(tmp_path, "bob", vectors(seed=9))
    (tmp_path / "alice").mkdir()
    cache = IndexCache(tmp_path)
    with pytest.raises(StoredRoutingError, match="alice") as info:
        cache.get("alice")  # alice has no vectors: bob's are never a fallback
    assert isinstance(info.value.__cause__, FileNotFoundError)
    for bad in ("../bob", "alice/../bob", "/abs", "..", ""):
        with pytest.raises(RoutingError, match="plain name"):
            cache.get(bad)
    (tmp_path / "carol").symlink_to(tmp_path / "bob")
    with pytest.raises(RoutingError, match="outside"):
        cache.get("carol")
    (tmp_path / "dave").mkdir()
    (tmp_path / "dave" / "embeddings.npy").symlink_to(tmp_path / "bob" / "embeddings.npy")
    with pytest.raises(RoutingError, match="outside the folder of client 'dave'"):
        cache.get("dave")
    assert cache.get("bob").raw.shape == (40, 16)
    assert IndexCache.for_run(tmp_path).root == tmp_path / "adapters" / "clients"
    with pytest.raises(RoutingError, match="capacity"):
        IndexCache(tmp_path, capacity=0)


def test_an_index_records_its_pooling_and_a_missing_record_means_last(tmp_path: Path) -> None:
    from routing.cache import check_index_pooling, index_pooling, kind_file

    vectors = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    EmbeddingIndex(vectors, pooling="mean").save(tmp_path / "a")
    EmbeddingIndex(vectors).save(tmp_path / "b")
    assert EmbeddingIndex.load(tmp_path / "a").pooling == index_pooling(tmp_path / "a") == "mean"
    kind_file(tmp_path / "b").unlink()  # an index written before the record existed
    assert EmbeddingIndex.load(tmp_path / "b").pooling == "last"
    check_index_pooling({"a": tmp_path / "a"}, "mean")
    with pytest.raises(RoutingError, match=r"clients \['b'\] holds 'last'.*calibrate RUN --feddpa-embedding mean"):
        check_index_pooling({"a": tmp_path / "a", "b": tmp_path / "b"}, "mean", run="RUN")
    kind_file(tmp_path / "a").write_text('{"embedding": "max"}')
    with pytest.raises(RoutingError, match="'last'.*'mean'"):
        index_pooling(tmp_path / "a")
