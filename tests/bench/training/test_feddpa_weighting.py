"""``bench.training.feddpa_weighting`` compares the rules on validation prompts from training data, never test data."""

from __future__ import annotations

import numpy as np
import pytest

from bench.training import feddpa_weighting as bench
from training.data.records import ClientData, FederatedDataset, Record


class Untouchable(dict):
    def __getattribute__(self, name: str):  # noqa: ANN204 - any use of the test sets fails the test
        raise AssertionError(f"the bench read the test sets ({name})")


def test_split_is_disjoint_training_data_and_never_reads_tests() -> None:
    clients = tuple(ClientData(f"c{k}", f"t{k}", tuple(Record(f"q{k}-{i}", f"a{i}") for i in range(10)))
                    for k in range(2))
    ds = FederatedDataset("d", clients, tests=Untouchable())
    splits = bench.split_training(ds, n_train=6, n_val=3)
    for c in clients:
        index, val = splits[c.client_id]
        assert len(index) == 6 and len(val) == 3 and not set(index) & set(val) and set(index + val) <= set(c.train)
    with pytest.raises(SystemExit, match="too few"):
        bench.split_training(ds, n_train=6, n_val=9)


def test_measure_scores_validation_prompts_and_refuses_test_embeddings() -> None:
    rng = np.random.default_rng(0)
    data: dict[str, np.ndarray] = {"bg": rng.normal(size=(40, 16)).astype(np.float32)}
    for k in range(2):
        centre = rng.normal(scale=4.0, size=16)
        data[f"train/c{k}"] = (centre + rng.normal(size=(30, 16))).astype(np.float32)
        data[f"val/c{k}"] = (centre + rng.normal(size=(8, 16))).astype(np.float32)
        data[f"task/c{k}"] = np.array([f"t{k}"])
    summary = bench.measure(data)
    assert summary["calibrated"]["auc_mean"] > 0.9  # own validation prompts apart from the other client's
    assert set(summary["per_client"]) == {"c0", "c1"}
    with pytest.raises(SystemExit, match="test prompts"):
        bench.measure({**data, "test/t0": data["val/c0"]})
