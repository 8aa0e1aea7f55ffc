"""`<client>` targets of a trained FedDPA-T run get instance-wise weights from the run's embeddings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from fedmosaic.tiny import tiny_llama
from serving.api.app import create_app
from serving.settings import ServeSettings
from training.data import generate_suite
from training.runtime import preset
from training.simulation import SimConfig, run_federated

FAMILIES = ["sorting", "capitals"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "run"
    run_federated("feddpa-t", generate_suite(n_train=6, n_test=2, families=FAMILIES), tiny_llama(), out,
                  SimConfig(rounds=2), preset("tiny"), {"alpha": 0.5}, data_spec="generated",
                  model_name="tiny")
    return out


def serve(run_dir: Path, routing: str) -> TestClient:
    return TestClient(create_app(ServeSettings(model="tiny", run_dir=run_dir, feddpa_routing=routing)))


def ready(client: TestClient) -> None:
    for _ in range(300):
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(client.get("/health").json())


def test_instance_weights_follow_the_paper_rule(run_dir: Path) -> None:
    with serve(run_dir, "instance") as client:
        ready(client)
        body = client.post("/v1/chat/completions", json={
            "model": "sorting", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "Sort these words alphabetically: pear, apple"}]}).json()
        info, weights = body["fedmosaic"]["info"], body["fedmosaic"]["weights"]
        assert info["source"] == "instance" and info["mode"] == "random" and info["S"] == 5
        a = info["a"]
        assert a == pytest.approx(min(1.0, max(0.0, 0.5 * info["mean_similarity"])), abs=1e-6)
        assert weights == pytest.approx({"global": 1 - a, "sorting:local": a})
        other = client.post("/v1/chat/completions", json={
            "model": "capitals", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Capital of Peru?"}]}).json()
        assert set(other["fedmosaic"]["weights"]) == {"global", "capitals:local"}  # never another client's adapter


def test_fixed_mode_uses_the_runs_alpha(run_dir: Path) -> None:
    with serve(run_dir, "fixed") as client:
        ready(client)
        body = client.post("/v1/chat/completions", json={
            "model": "capitals", "max_tokens": 2, "messages": [{"role": "user", "content": "Capital of Peru?"}]}).json()
        assert body["fedmosaic"]["weights"] == {"global": 0.5, "capitals:local": 0.5}


def test_seeded_random_draws_depend_on_the_prompt_not_on_request_order(run_dir: Path) -> None:
    import torch

    from serving.feddpa_router import InstanceWeightRouter

    width = tiny_llama().model.config.hidden_size
    states = [torch.randn(width, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    first = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, S=2, seed=0)
    forward = [first("sorting", s).info["mean_similarity"] for s in states]
    again = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, S=2, seed=0)  # e.g. a resumed evaluation
    backward = [again("sorting", s).info["mean_similarity"] for s in reversed(states)]
    assert forward == backward[::-1]
    other = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, S=2, seed=1)
    assert [other("sorting", s).info["mean_similarity"] for s in states] != forward  # the seed matters
