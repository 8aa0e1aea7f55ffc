"""`<client>` targets of a trained FedDPA-T run get instance-wise weights from the run's embeddings."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from models import tiny_llama
from routing.feddpa_options import FedDPAOptions
from serving.settings import ServeSettings
from tests.serving.helpers import ready_client

PAPER_S2 = FedDPAOptions(weighting="paper", samples=2)  # the paper's rule over S = 2 instances


@pytest.fixture(scope="module")
def run_dir(feddpa_run: Path) -> Path:
    return feddpa_run  # trained once for the serving tests (sorting, capitals); copied before a change


def serve(run_dir: Path, routing: str, **settings: object) -> AbstractContextManager[TestClient]:
    settings.setdefault("feddpa_weighting", None if routing == "fixed" else "paper")  # the paper rule's tests
    return ready_client(ServeSettings(model="tiny", run_dir=run_dir, feddpa_routing=routing,
                                      **settings))  # type: ignore[arg-type]


def test_instance_weights_follow_the_paper_rule(run_dir: Path) -> None:
    with serve(run_dir, "instance", routing_details="all") as client:
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


def test_calibrated_weights_by_default_from_the_clients_own_calibration(run_dir: Path) -> None:
    from routing.calibration import Calibration

    with serve(run_dir, "instance", feddpa_weighting=None, routing_details="all") as client:
        body = client.post("/v1/chat/completions", json={
            "model": "sorting", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Sort these words alphabetically: pear, apple"}]}).json()
        info, weights = body["fedmosaic"]["info"], body["fedmosaic"]["weights"]
        cal = Calibration.load(run_dir / "adapters" / "clients" / "sorting")
        assert cal is not None and info["weighting"] == "calibrated"
        assert (info["own"], info["background"]) == (cal.own, cal.background)  # sorting's file, not capitals'
        assert info["a"] == pytest.approx(cal.weight(info["score"], 0.5))
        assert weights == pytest.approx({"global": 1 - info["a"], "sorting:local": info["a"]})


def test_fixed_mode_uses_the_runs_alpha(run_dir: Path) -> None:
    with serve(run_dir, "fixed") as client:
        body = client.post("/v1/chat/completions", json={
            "model": "capitals", "max_tokens": 2, "messages": [{"role": "user", "content": "Capital of Peru?"}]}).json()
        assert body["fedmosaic"]["weights"] == {"global": 0.5, "capitals:local": 0.5}


def test_seeded_random_draws_depend_on_the_prompt_not_on_request_order(run_dir: Path) -> None:
    import torch

    from routing.instance import InstanceWeightRouter

    width = tiny_llama().model.config.hidden_size
    states = [torch.randn(width, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    first = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, options=PAPER_S2, seed=0)
    forward = [first("sorting", s).info["mean_similarity"] for s in states]
    again = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, options=PAPER_S2, seed=0)  # e.g. a resumed evaluation
    backward = [again("sorting", s).info["mean_similarity"] for s in reversed(states)]
    assert forward == backward[::-1]
    other = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, options=PAPER_S2, seed=1)
    assert [other("sorting", s).info["mean_similarity"] for s in states] != forward  # the seed matters


def test_seeded_random_draws_key_on_the_prompt_ids_not_the_states_rounding(run_dir: Path) -> None:
    """A prompt prefilled in another batch or after a reused prefix has its state moved by rounding: with
    the prompt's ids the draw (and so the weight) stays put; other prompts draw other instances."""
    import torch

    from routing.base import WeightRouter
    from routing.instance import InstanceWeightRouter

    width = tiny_llama().model.config.hidden_size
    router = InstanceWeightRouter.for_run(run_dir, lambda_=0.5, options=PAPER_S2, seed=0)
    assert isinstance(router, WeightRouter) and router.uses_state  # the engine hands it the state and the ids
    state = torch.randn(width, generator=torch.Generator().manual_seed(3))
    nudged = state + 1e-6 * torch.randn(width, generator=torch.Generator().manual_seed(4))
    ids = [[7, 8, 9, n] for n in range(8)]
    draws = [router("sorting", state, prompt_ids=i).info["mean_similarity"] for i in ids]
    again = [router("sorting", nudged, prompt_ids=i).info["mean_similarity"] for i in ids]
    assert again == pytest.approx(draws, abs=1e-5)
    assert len({round(d, 4) for d in draws}) > 1  # the ids choose the instances


SORT = {"model": "sorting", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "Sort these words alphabetically: pear, apple"}]}


def test_routing_details_are_for_admin_keys_by_default(run_dir: Path) -> None:
    """Privacy default: a user sees the mode and the weights, never the similarity to stored instances."""
    with serve(run_dir, "instance", api_keys=["user"], admin_keys=["admin"]) as client:
        user = client.post("/v1/chat/completions", json=SORT, headers={"Authorization": "Bearer user"}).json()
        admin = client.post("/v1/chat/completions", json=SORT, headers={"Authorization": "Bearer admin"}).json()
    assert user["fedmosaic"]["info"] == {"source": "instance", "mode": "random"}
    # the weights are the response's own (the repeat reuses the first's prompt prefix: equal up to rounding)
    assert user["fedmosaic"]["weights"] == pytest.approx(admin["fedmosaic"]["weights"], abs=1e-6)
    assert {"mean_similarity", "S", "lambda", "a"} <= set(admin["fedmosaic"]["info"])
    with serve(run_dir, "instance", routing_details="none", admin_keys=["admin"]) as client:
        hidden = client.post("/v1/chat/completions", json=SORT, headers={"Authorization": "Bearer admin"}).json()
    assert "mean_similarity" not in hidden["fedmosaic"]["info"]


def test_a_reloaded_clients_index_is_read_again(run_dir: Path, tmp_path: Path) -> None:
    """The router's cache key follows the adapter version: new embeddings count from the reload on."""
    import shutil

    from routing.cache import EmbeddingIndex

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    folder = run / "adapters" / "clients" / "sorting"
    with serve(run, "instance", routing_details="all", admin_keys=["admin"]) as client:
        auth = {"Authorization": "Bearer admin"}
        before = client.post("/v1/chat/completions", json=SORT, headers=auth).json()["fedmosaic"]["info"]
        EmbeddingIndex(-EmbeddingIndex.load(folder).raw).save(folder)  # retrained: other instances
        cached = client.post("/v1/chat/completions", json=SORT, headers=auth).json()["fedmosaic"]["info"]
        # same version: the cached index (the repeat reuses the prompt's prefix: equal up to rounding)
        assert cached["mean_similarity"] == pytest.approx(before["mean_similarity"], abs=1e-6)
        reload = client.post("/v1/load_lora_adapter", headers=auth, json={
            "lora_name": "sorting:local", "lora_path": "adapters/clients/sorting/local", "load_inplace": True})
        assert reload.status_code == 200, reload.text
        after = client.post("/v1/chat/completions", json=SORT, headers=auth).json()["fedmosaic"]["info"]
    assert after["mean_similarity"] == pytest.approx(-before["mean_similarity"], abs=1e-5)


def test_a_clients_broken_calibration_is_the_servers_fault_and_spares_the_others(run_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """A malformed file in the run folder fails that client's requests with 500 and a request id (the
    request was fine); the other clients and the engine go on serving."""
    import json
    import shutil

    from routing.calibration import CALIBRATION_FILE

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    path = run / "adapters" / "clients" / "capitals" / CALIBRATION_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "shrinkage": 5}))
    with serve(run, "instance", feddpa_weighting=None) as client:
        broken = client.post("/v1/chat/completions", json={
            "model": "capitals", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Capital of Peru?"}]})
        assert broken.status_code == 500 and "request" in broken.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=SORT).status_code == 200
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("prefill", ["exact", "once"])
def test_feddpa_prefill_exact_runs_the_prompt_twice_and_once_keeps_the_routing_pass(run_dir: Path,
                                                                                    prefill: str) -> None:
    with serve(run_dir, "instance", feddpa_prefill=prefill) as client:
        engine = client.app.state.server.engine  # type: ignore[attr-defined]
        seen: list[int] = []
        engine.step_observers.append(lambda report: seen.append(report.prefill_tokens))
        body = client.post("/v1/completions", json={
            "model": "sorting", "max_tokens": 3, "temperature": 0,
            "prompt": "Sort these words alphabetically: pear, apple"}).json()
        a, prompt = body["fedmosaic"]["weights"]["sorting:local"], body["usage"]["prompt_tokens"]
        assert a > 0  # routed away from the routing pass's own weights: the exact rule prefills again
        assert sum(seen) == (2 if prefill == "exact" else 1) * prompt


def test_feddpa_prefill_option_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from serving.cli import add_serve_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(["serve"])).feddpa_prefill == "exact"
    assert settings_from_args(parser.parse_args(["serve", "--feddpa-prefill", "once"])).feddpa_prefill == "once"
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_PREFILL", "once")
    assert settings_from_args(parser.parse_args(["serve"])).feddpa_prefill == "once"
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_PREFILL", "twice")
    with pytest.raises(SystemExit, match="feddpa_prefill"):
        settings_from_args(parser.parse_args(["serve"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--feddpa-prefill", "twice"])
