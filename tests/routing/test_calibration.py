"""Calibrated FedDPA weighting: the mapping on constructed cases, held-out scores, round trips, isolation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from routing import EmbeddingIndex, FedDPARouter, IndexCache, RoutingError
from routing.background import BACKGROUND_PROMPTS, background_id
from routing.calibration import CALIBRATION_FILE, Calibration, calibrate, fingerprint, scores
from routing.gaussian import Gaussian, held_out_sq_distances, ledoit_wolf_shrinkage

H = 64


def states(rng: np.random.Generator, topic: np.ndarray | None, n: int) -> np.ndarray:
    """Final-layer-like states: one large shared direction (cosine ~0.9 between any two), a topic, noise."""
    common = np.zeros(H, dtype=np.float32)
    common[0] = 12.0
    x = common + rng.normal(scale=1.0, size=(n, H)).astype(np.float32)
    if topic is not None:
        x += 4.0 * topic
    return x


@pytest.fixture(scope="module")
def world() -> dict[str, np.ndarray]:
    """Client A's task, three other tasks, and a background of prompts on many random topics."""
    rng = np.random.default_rng(0)
    topics = rng.normal(size=(40, H)).astype(np.float32)
    topics[:, 0] = 0.0
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)
    background = np.concatenate([states(rng, topics[i], 4) for i in range(4, 40)])  # 144 generic prompts
    return {"own_train": states(rng, topics[0], 120), "own_test": states(rng, topics[0], 50),
            "other_test": np.concatenate([states(rng, topics[i], 50) for i in (1, 2, 3)]),
            "background": background}


@pytest.fixture(scope="module")
def structured() -> dict[str, np.ndarray]:
    """States with structure, as final-layer states have: each task varies along a few directions of its
    own and little elsewhere. Task B sits along client A's direction (from the background's centre) but
    off A's spread: a cosine to A's centroid cannot tell it from A, a Gaussian of A's states can."""
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.normal(size=(H - 1, H - 1)))
    basis = np.zeros((H, H), dtype=np.float32)
    basis[1:, 1:] = q  # orthonormal; e0 is the shared direction

    def task(center: np.ndarray, dirs: list[int], n: int, spread: float = 2.0, noise: float = 0.2) -> np.ndarray:
        common = np.zeros(H, dtype=np.float32)
        common[0] = 12.0
        return (common + center + rng.normal(scale=spread, size=(n, len(dirs))) @ basis[dirs]
                + rng.normal(scale=noise, size=(n, H))).astype(np.float32)

    background = np.concatenate([task(4 * basis[i], [i + 20, i + 21], 4, noise=1.0) for i in range(10, 40)])
    return {"own_train": task(4 * basis[1], [2, 3, 4, 5, 6], 120), "own_test": task(4 * basis[1], [2, 3, 4, 5, 6], 50),
            "other_test": task(4 * basis[1] + 3 * basis[7], [8, 9, 10, 11, 12], 50), "background": background}


def weights(router: FedDPARouter, index: EmbeddingIndex, queries: np.ndarray) -> np.ndarray:
    return np.array([router.decide(q, index, client="a").info["a"] for q in queries])


def test_gaussian_tells_a_task_along_the_clients_direction_from_the_clients_own(
        structured: dict[str, np.ndarray]) -> None:
    lam = 0.5
    router = FedDPARouter(lambda_=lam, weighting="calibrated")
    got = {}
    for statistic in ("mahalanobis", "centroid"):
        cal = calibrate(structured["own_train"], structured["background"], statistic=statistic)  # type: ignore[arg-type]
        index = EmbeddingIndex(structured["own_train"], calibration=cal)
        got[statistic] = (weights(router, index, structured["own_test"]),
                          weights(router, index, structured["other_test"]))
    own, other = got["mahalanobis"]
    assert np.median(own) == pytest.approx(lam) and own.mean() > 0.85 * lam
    assert (other == 0.0).all()  # the right answer: B is not A's task
    c_own, c_other = got["centroid"]
    assert c_other.mean() > 0.8 * c_own.mean()  # the centroid score takes B for A


# knn's top-k of noisy neighbours scatters more than the mean over every instance
@pytest.mark.parametrize(("statistic", "own_mean"), [("centroid", 0.7), ("knn", 0.5)])
def test_own_typical_near_lambda_unrelated_near_zero(world: dict[str, np.ndarray], statistic: str,
                                                     own_mean: float) -> None:
    lam = 0.5
    cal = calibrate(world["own_train"], world["background"], statistic=statistic)  # type: ignore[arg-type]
    index = EmbeddingIndex(world["own_train"], calibration=cal)
    calibrated = FedDPARouter(lambda_=lam, weighting="calibrated")
    own, other = weights(calibrated, index, world["own_test"]), weights(calibrated, index, world["other_test"])
    assert np.median(own) > 0.8 * lam and own.mean() > own_mean * lam
    assert np.median(other) == 0.0 and other.mean() < 0.05 * lam
    # the paper's rule on the same states barely tells them apart (the 0.49 vs 0.44)
    paper = FedDPARouter(lambda_=lam, S=5, seed=0)
    p_own, p_other = weights(paper, index, world["own_test"]), weights(paper, index, world["other_test"])
    assert p_other.mean() > 0.8 * p_own.mean()
    # a prompt at the centre of the client's data gets exactly lambda, one at the background's centre 0
    assert calibrated.decide(world["own_train"].mean(0), index, client="a").info["a"] == pytest.approx(lam)
    assert calibrated.decide(world["background"].mean(0), index, client="a").info["a"] == 0.0


def test_leave_one_out_scores_match_a_naive_loop() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 8)).astype(np.float32)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    for statistic, k in (("centroid", 5), ("knn", 4)):
        got = scores(u, u, statistic, k, exclude_self=True)  # type: ignore[arg-type]
        for i in range(len(u)):
            sims = np.delete(u, i, 0) @ u[i]
            ref = sims.mean() if statistic == "centroid" else np.sort(sims)[-k:].mean()
            assert got[i] == pytest.approx(ref, abs=1e-5)


def test_decision_info_and_weights(world: dict[str, np.ndarray], structured: dict[str, np.ndarray]) -> None:
    cal = calibrate(structured["own_train"], structured["background"])
    index = EmbeddingIndex(structured["own_train"], calibration=cal)
    d = FedDPARouter(lambda_=0.5, weighting="calibrated").decide(structured["own_test"][0], index, client="a")
    info = dict(d.info)
    assert info["weighting"] == "calibrated" and info["statistic"] == "mahalanobis"
    assert info["a"] == pytest.approx(cal.weight(info["score"], 0.5))
    assert d.names == ("global", "a:local") and d.weights.tolist() == pytest.approx([1 - info["a"], info["a"]])
    # without a calibration the paper's rule answers, and says so
    plain = FedDPARouter(lambda_=0.5, weighting="calibrated", seed=0).decide(world["own_test"][0],
                                                                            EmbeddingIndex(world["own_train"]))
    assert plain.info["weighting"] == "paper" and "no calibration" in plain.info["note"]
    with pytest.raises(RoutingError, match="weighting"):
        FedDPARouter(weighting="tuned")  # type: ignore[arg-type]


def test_calibration_round_trip_through_the_index_files(tmp_path: Path, world: dict[str, np.ndarray]) -> None:
    cal = calibrate(world["own_train"], world["background"], statistic="knn", k=3, background_id=background_id())
    EmbeddingIndex(world["own_train"], calibration=cal).save(tmp_path)
    data = json.loads((tmp_path / CALIBRATION_FILE).read_text())
    assert data["summary"]["background_id"].startswith("generic-v1:") and data["k"] == 3
    loaded = EmbeddingIndex.load(tmp_path)
    assert loaded.calibration is not None
    assert (loaded.calibration.own, loaded.calibration.background, loaded.calibration.statistic) == \
        (cal.own, cal.background, "knn")
    np.testing.assert_array_equal(loaded.calibration.center, cal.center)
    router = FedDPARouter(lambda_=0.5, weighting="calibrated")
    q = world["own_test"][:5]
    assert weights(router, loaded, q).tolist() == weights(router, EmbeddingIndex(world["own_train"],
                                                                                 calibration=cal), q).tolist()
    # an index saved without a calibration drops the file of the earlier vectors
    EmbeddingIndex(world["other_test"]).save(tmp_path)
    assert not (tmp_path / CALIBRATION_FILE).exists() and EmbeddingIndex.load(tmp_path).calibration is None


def test_stale_or_malformed_calibration_is_refused(tmp_path: Path, world: dict[str, np.ndarray]) -> None:
    cal = calibrate(world["own_train"], world["background"])
    assert cal.fingerprint == fingerprint(world["own_train"])
    with pytest.raises(RoutingError, match="fedmosaic calibrate"):
        EmbeddingIndex(world["other_test"], calibration=cal)
    EmbeddingIndex(world["own_train"]).save(tmp_path)
    cal.save(tmp_path)
    np.save(tmp_path / "embeddings.npy", world["other_test"])  # vectors rewritten, calibration left behind
    with pytest.raises(RoutingError, match="does not match"):
        EmbeddingIndex.load(tmp_path, use_faiss=False)
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(RoutingError, match="format"):
        Calibration.load(tmp_path)
    with pytest.raises(RoutingError, match="at least 2"):
        calibrate(world["own_train"][:1], world["background"])
    with pytest.raises(RoutingError, match="share H"):
        calibrate(world["own_train"], world["background"][:, :8])


def test_a_request_for_a_reads_only_as_calibration(tmp_path: Path, world: dict[str, np.ndarray]) -> None:
    """Isolation: A's decision uses A's index and calibration, never B's, even through a symlink."""
    for client, train in (("a", world["own_train"]), ("b", world["other_test"])):
        EmbeddingIndex(train, calibration=calibrate(train, world["background"])).save(tmp_path / client)
    cache = IndexCache(tmp_path)
    a_cal = Calibration.load(tmp_path / "a")
    index = cache.get("a")
    assert index.calibration is not None and a_cal is not None and index.calibration.own == a_cal.own
    assert [k[0] for k in cache.keys()] == ["a"]  # B's files were never loaded
    (tmp_path / "c").mkdir()
    np.save(tmp_path / "c" / "embeddings.npy", world["own_train"])
    (tmp_path / "c" / CALIBRATION_FILE).symlink_to(tmp_path / "b" / CALIBRATION_FILE)
    with pytest.raises(RoutingError, match="outside the folder"):
        cache.get("c")


def test_background_prompts_are_many_distinct_and_named() -> None:
    assert len(BACKGROUND_PROMPTS) >= 120 and len(set(BACKGROUND_PROMPTS)) == len(BACKGROUND_PROMPTS)
    assert background_id().startswith("generic-v1:") and background_id(["x", "y"]).startswith("custom:")


def test_gaussian_distances_match_a_naive_inverse_and_the_held_out_loop() -> None:
    rng = np.random.default_rng(5)
    q = rng.normal(size=(7, 12)).astype(np.float32)
    for n in (40, 8):  # more instances than dimensions (covariance path) and fewer (Gram path)
        x = (rng.normal(size=(n, 12)) * np.linspace(0.1, 3.0, 12)).astype(np.float32)
        for g in (0.0, 0.3, 1.0):
            fit = Gaussian.fit(x, g)
            s = np.cov(x.T.astype(np.float64), bias=True)
            sigma = (1 - max(g, 1e-6)) * s + max(g, 1e-6) * np.trace(s) / 12 * np.eye(12)
            z = q - x.mean(0)
            ref = np.einsum("qh,hk,qk->q", z, np.linalg.inv(sigma), z)
            np.testing.assert_allclose(fit.sq_distance(q), ref, rtol=2e-4)
    x = (rng.normal(size=(40, 12)) * np.linspace(0.1, 3.0, 12)).astype(np.float32)
    held = held_out_sq_distances(x, 0.2, folds=5, seed=0)
    order = np.random.default_rng(0).permutation(40)
    for f in range(5):
        test = order[f::5]
        ref = Gaussian.fit(np.delete(x, test, 0), 0.2).sq_distance(x[test])
        np.testing.assert_allclose(held[test], ref, rtol=1e-5)
    with pytest.raises(RoutingError, match="shrinkage"):
        Gaussian.fit(x, 1.5)
    with pytest.raises(RoutingError, match="finite"):
        Gaussian.fit(np.full((3, 4), np.nan), 0.1)


def test_ledoit_wolf_matches_scikit_learn() -> None:
    covariance = pytest.importorskip("sklearn.covariance")
    rng = np.random.default_rng(6)
    for n, h in ((30, 50), (200, 20)):
        x = rng.normal(size=(n, h)) * rng.uniform(0.1, 4.0, size=h)
        assert ledoit_wolf_shrinkage(x) == pytest.approx(covariance.ledoit_wolf_shrinkage(x), rel=1e-6)
    assert ledoit_wolf_shrinkage(np.ones((5, 3))) == 1.0


def test_conformal_map_on_known_scores() -> None:
    cal = Calibration(np.zeros(2, dtype=np.float32), own=-3.0, background=-10.0, statistic="mahalanobis",
                      own_scores=(-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0), own_quantile=0.25)
    assert cal.own_scores[0] == -8.0  # kept ascending
    lam = 0.5
    assert cal.weight(-12.0, lam) == 0.0 and cal.weight(-10.0, lam) == 0.0  # no closer than the background
    assert cal.weight(-9.0, lam) == 0.0  # less typical than every own instance
    assert cal.weight(-8.0, lam) == pytest.approx(lam * (1 / 8) / 0.25)
    assert cal.weight(-7.5, lam) == pytest.approx(lam * 0.5)
    assert cal.weight(-7.0, lam) == lam and cal.weight(0.0, lam) == lam


def test_format_2_round_trip_and_format_1_still_read(tmp_path: Path, structured: dict[str, np.ndarray],
                                                      world: dict[str, np.ndarray]) -> None:
    cal = calibrate(structured["own_train"], structured["background"])
    assert cal.statistic == "mahalanobis" and 0.0 < cal.shrinkage <= 1.0 and len(cal.own_scores) == 120
    EmbeddingIndex(structured["own_train"], calibration=cal).save(tmp_path / "a")
    loaded = EmbeddingIndex.load(tmp_path / "a", use_faiss=False)
    assert loaded.calibration is not None and loaded.calibration.own_scores == cal.own_scores
    assert loaded.calibration.shrinkage == cal.shrinkage
    router = FedDPARouter(lambda_=0.5, weighting="calibrated")
    q = np.concatenate([structured["own_test"][:5], structured["other_test"][:5]])
    assert weights(router, loaded, q).tolist() == weights(router, EmbeddingIndex(structured["own_train"],
                                                                                 calibration=cal), q).tolist()
    # a run calibrated before format 2: its file keeps its centroid ramp
    old = calibrate(world["own_train"], world["background"], statistic="centroid").to_json()
    for key in ("shrinkage", "own_scores", "own_quantile"):
        old.pop(key)
    old["format"] = 1
    EmbeddingIndex(world["own_train"]).save(tmp_path / "b")
    (tmp_path / "b" / CALIBRATION_FILE).write_text(json.dumps(old))
    index = EmbeddingIndex.load(tmp_path / "b", use_faiss=False)
    assert index.calibration is not None and index.calibration.statistic == "centroid"
    a = weights(router, index, world["own_test"][:5])
    assert a.tolist() == [index.calibration.weight(index.calibrated_score(v), 0.5) for v in world["own_test"][:5]]
    old["statistic"] = "mahalanobis"
    (tmp_path / "b" / CALIBRATION_FILE).write_text(json.dumps(old))
    with pytest.raises(RoutingError, match="format-1"):
        Calibration.load(tmp_path / "b")


def test_gain_scales_lambda_and_round_trips(tmp_path: Path, structured: dict[str, np.ndarray]) -> None:
    cal = calibrate(structured["own_train"], structured["background"])
    assert cal.gain == 1.0 and cal.gate == {}
    gate = {"metric": "rouge1", "lambda": 0.5, "global": 41.0, "mixed": 23.0, "n": 30, "gain": 0.0}
    off = Calibration(**{**cal.__dict__, "gain": 0.0, "gate": gate})
    router = FedDPARouter(lambda_=0.5, weighting="calibrated")
    own = structured["own_test"][:10]
    on_weights = weights(router, EmbeddingIndex(structured["own_train"], calibration=cal), own)
    assert on_weights.max() == 0.5  # the client's own prompts get lambda ...
    off_index = EmbeddingIndex(structured["own_train"], calibration=off)
    assert weights(router, off_index, own).tolist() == [0.0] * 10  # ... unless its gate closed
    closed = router.decide(own[0], off_index, client="a").info
    assert closed["gain"] == 0.0 and closed["a"] == 0.0
    # what the scores alone give is still reported: the gate, not the estimator, set a to 0
    opened = router.decide(own[0], EmbeddingIndex(structured["own_train"], calibration=cal), client="a").info
    assert closed["a_before_gate"] == opened["a"] == opened["a_before_gate"] > 0.0
    off.save(tmp_path)
    data = json.loads((tmp_path / CALIBRATION_FILE).read_text())
    assert data["format"] == 3 and data["gain"] == 0.0 and data["gate"] == gate
    back = Calibration.load(tmp_path)
    assert back is not None and back.gain == 0.0 and back.gate == gate
    data["format"] = 2  # written before the gate: no check, full lambda
    for key in ("gain", "gate"):
        data.pop(key)
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(data))
    old = Calibration.load(tmp_path)
    assert old is not None and old.gain == 1.0 and old.own_scores == cal.own_scores
    data["format"] = 3  # format 3 must say its gain
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(data))
    with pytest.raises(RoutingError, match="malformed.*gain"):
        Calibration.load(tmp_path)
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(RoutingError, match="gain"):
            Calibration(**{**cal.__dict__, "gain": bad})
