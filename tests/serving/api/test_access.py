"""Issue 15 items 1-3 over HTTP: roles, tenant-bound keys, runtime loading rules, privacy of names and paths."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from models import tiny_llama
from serving.access import AccessConfigError, KeyRing
from serving.api import create_app
from serving.cli import add_serve_arguments, settings_from_args
from serving.settings import ServeSettings
from tests.serving.helpers import free_port, ready_client, wait_healthy, write_adapter, write_feddpa_run

USER, ADMIN, SORTING, MODELS = "sk-user", "sk-admin", "sk-sorting", "sk-models"
CHAT = {"messages": [{"role": "user", "content": "Sort: pear, apple"}], "max_tokens": 2, "temperature": 0}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("access")
    tiny = tiny_llama()
    write_feddpa_run(root / "run", ("sorting", "capitals"), tiny)
    write_adapter(tiny, root / "extra", seed=5)
    (root / "admins.txt").write_text(f"# the operators\n\n{ADMIN}\n")
    (root / "users.txt").write_text(f"{USER}\n")
    (root / "bindings.json").write_text(json.dumps({"keys": [
        {"key": SORTING, "clients": ["sorting"], "name": "sorting"},
        {"key": MODELS, "models": ["global", "extra"]}]}))
    return root


@pytest.fixture(scope="module")
def client(root: Path) -> Iterator[TestClient]:
    settings = ServeSettings(model="tiny", run_dir=root / "run", adapter_root=root, api_key_file=root / "users.txt",
                             admin_key_file=root / "admins.txt", key_bindings=root / "bindings.json",
                             protect_metrics=True, max_tokens_limit=16)
    with ready_client(settings) as client:
        yield client


def error(response, status: int, code: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert code is None or body["code"] == code, body
    return body  # type: ignore[no-any-return]


def chat(client: TestClient, key: str, model: str, **extra: object) -> object:
    return client.post("/v1/chat/completions", json={**CHAT, "model": model, **extra}, headers=auth(key))


def models(client: TestClient, key: str) -> list[str]:
    return [m["id"] for m in client.get("/v1/models", headers=auth(key)).json()["data"]]


def test_roles(client: TestClient) -> None:
    load = {"lora_name": "extra", "lora_path": "extra"}
    error(client.post("/v1/load_lora_adapter", json=load, headers=auth(USER)), 403)
    error(client.post("/v1/load_lora_adapter", json=load), 401, "unauthorized")
    error(client.get("/v1/run/files", headers=auth(USER)), 403)
    error(client.get("/metrics", headers=auth(USER)), 403)
    error(client.get("/metrics"), 401)
    metrics = client.get("/metrics", headers=auth(ADMIN))
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert chat(client, USER, "sorting").status_code == 200  # type: ignore[attr-defined]
    assert chat(client, ADMIN, "capitals").status_code == 200  # type: ignore[attr-defined]
    assert client.post("/v1/load_lora_adapter", json=load, headers=auth(ADMIN)).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=auth(ADMIN)).status_code == 200


@pytest.mark.parametrize("header", ["Bearer sk-\u00e9\u00e8", "Bearer \u00ff" * 3, "Basic abc", "Bearer", ""])
def test_bad_tokens_are_401_never_500(client: TestClient, header: str) -> None:
    raw = header.encode("latin-1")  # what a client puts on the wire, non-ASCII bytes included
    response = client.get("/v1/models", headers=[(b"authorization", raw)] if header else [])
    error(response, 401, "unauthorized")


def test_a_key_bound_to_a_client_reaches_its_targets_only(client: TestClient) -> None:
    assert models(client, SORTING) == ["tiny", "global", "sorting:local", "sorting"]
    for model in ("sorting", "sorting:local", "global", "tiny"):
        assert chat(client, SORTING, model).status_code == 200, model  # type: ignore[attr-defined]
    for model in ("capitals", "capitals:local", "nope"):
        body = error(chat(client, SORTING, model), 404, "model_not_found")
        assert "capitals" not in body["message"].replace(model, "") and "available" not in body["message"]
    mixture = [{"name": "global", "weight": 0.5}, {"name": "capitals:local", "weight": 0.5}]
    error(chat(client, SORTING, "sorting", adapters=mixture), 404)
    assert models(client, MODELS) == ["global"]  # extra is not loaded: listed once it is
    assert chat(client, MODELS, "global").status_code == 200  # type: ignore[attr-defined]
    error(chat(client, MODELS, "tiny"), 404)
    assert set(models(client, USER)) == set(models(client, ADMIN)) == {
        "tiny", "global", "sorting:local", "capitals:local", "sorting", "capitals"}


def test_models_show_no_absolute_path_and_errors_list_no_clients(client: TestClient, root: Path) -> None:
    cards = client.get("/v1/models", headers=auth(ADMIN)).json()["data"]
    assert {c["id"]: c["root"] for c in cards}["global"] == "run/adapters/global"
    assert str(root) not in json.dumps(cards)
    body = error(chat(client, USER, "nope"), 404)
    assert "sorting" not in body["message"] and "capitals" not in body["message"]
    body = error(chat(client, USER, "tiny", adapters=[{"name": "nope", "weight": 1}]), 404)
    assert "sorting" not in body["message"] and "global" not in body["message"]


def test_pinned_adapters_need_force_and_names_cannot_be_shadowed(client: TestClient) -> None:
    admin = auth(ADMIN)
    error(client.post("/v1/unload_lora_adapter", json={"lora_name": "global"}, headers=admin), 409, "adapter_pinned")
    assert chat(client, USER, "sorting").status_code == 200  # type: ignore[attr-defined]
    for name in ("sorting", "capitals", "tiny", "global"):  # a client, the base model, the run's global
        body = error(client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "extra"},
                                 headers=admin), 400, "name_reserved")
        assert name in body["message"]
    error(client.post("/v1/load_lora_adapter", json={"lora_name": "sorting:local", "lora_path": "extra",
                                                     "load_inplace": False}, headers=admin), 400)
    # an in-place reload of the run's own adapter is a new version, not a new meaning
    reload = client.post("/v1/load_lora_adapter", json={"lora_name": "global", "lora_path": "run/adapters/global",
                                                        "load_inplace": True}, headers=admin)
    assert reload.status_code == 200 and "version 2" in reload.text
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "pinned", "lora_path": "extra", "pinned": True},
                       headers=admin).status_code == 200
    error(client.post("/v1/load_lora_adapter", json={"lora_name": "pinned:local", "lora_path": "extra"},
                      headers=admin), 400, "name_reserved")  # would make 'pinned' a client too
    error(client.post("/v1/unload_lora_adapter", json={"lora_name": "pinned"}, headers=admin), 409)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "pinned", "force": True},
                       headers=admin).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "global", "force": True},
                       headers=admin).status_code == 200
    error(chat(client, USER, "sorting"), 404)  # every FedDPA client needs global
    restore = client.post("/v1/load_lora_adapter", json={"lora_name": "global", "lora_path": "run/adapters/global",
                                                         "pinned": True}, headers=admin)
    assert restore.status_code == 200, restore.text  # the run's own folder restores it
    assert chat(client, USER, "sorting").status_code == 200  # type: ignore[attr-defined]


def test_runtime_loading_is_off_without_admin_keys_and_needs_a_root(root: Path) -> None:
    load = {"lora_name": "x", "lora_path": str(root / "extra")}
    with ready_client(ServeSettings(model="tiny", api_keys=[USER])) as client:
        error(client.post("/v1/load_lora_adapter", json=load, headers=auth(USER)), 404)
    with ready_client(ServeSettings(model="tiny", admin_keys=[ADMIN])) as client:  # no run, no root
        body = error(client.post("/v1/load_lora_adapter", json=load, headers=auth(ADMIN)), 403, "path_not_allowed")
        assert "--adapter-root" in body["message"]
    # explicitly enabled on an open server: anyone may (the operator chose so)
    with ready_client(ServeSettings(model="tiny", adapter_root=root, allow_runtime_lora=True)) as client:
        assert client.post("/v1/load_lora_adapter", json={**load, "lora_path": "extra"}).status_code == 200


def test_keys_from_the_environment_and_files(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setenv("FEDMOSAIC_SERVE_API_KEYS", '["env-user"]')
    monkeypatch.setenv("FEDMOSAIC_SERVE_ADMIN_KEYS", "env-admin-1, env-admin-2")
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_ROUTING", "fixed")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["serve", "--model", "tiny", "--admin-key-file",
                                                     str(root / "admins.txt")]))
    assert settings.api_keys == ["env-user"] and settings.admin_keys == ["env-admin-1", "env-admin-2"]
    assert settings.feddpa_routing == "fixed" and settings.allow_runtime_lora is None  # no CLI default won
    with ready_client(settings) as client:
        for key in ("env-user", "env-admin-2", ADMIN):
            assert client.get("/v1/models", headers=auth(key)).status_code == 200
        error(client.get("/v1/models", headers=auth("other")), 401)
        error(client.get("/v1/models"), 401)
    given = settings_from_args(parser.parse_args(["serve", "--api-key", "cli", "--no-runtime-lora",
                                                  "--feddpa-routing", "instance"]))
    assert given.api_keys == ["cli"] and given.allow_runtime_lora is False and given.feddpa_routing == "instance"


def test_key_files_are_checked_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "bindings.json"
    for text in ("{", '{"keys": [{"key": "k"}]}', '{"keys": [{"key": "k", "clients": "sorting"}]}',
                 '{"keys": [{"key": "k", "models": ["a"], "role": "admin"}]}'):
        bad.write_text(text)
        with pytest.raises(AccessConfigError):
            KeyRing.build(binding_file=bad)
    with pytest.raises(AccessConfigError, match="different roles"):
        KeyRing.build(api_keys=["same"], admin_keys=["same"])
    with pytest.raises(AccessConfigError, match="cannot read"):
        KeyRing.build(api_key_file=tmp_path / "missing.txt")
    with pytest.raises(AccessConfigError):
        create_app(ServeSettings(model="tiny", key_bindings=tmp_path / "missing.json"))


def test_views_read_the_pool_under_its_lock_while_adapters_come_and_go(client: TestClient) -> None:
    """/v1/models, /metrics and target resolution iterate the pool's dictionaries while loads change them."""
    import threading

    state = client.app.state.server  # type: ignore[attr-defined]
    pool, resolver = state.pool, state.resolver
    stop, problems = threading.Event(), []

    def churn() -> None:
        i = 0
        while not stop.is_set():
            pool.load(f"churn{i % 4}", "extra", replace=True)
            pool.unload(f"churn{(i + 2) % 4}") if f"churn{(i + 2) % 4}" in pool else None
            i += 1

    def read() -> None:
        try:
            while not stop.is_set():
                resolver.models(), resolver.clients(), pool.info(), pool.loaded_count(), state.metrics.render()
                resolver.resolve("sorting")
        except Exception as exc:  # the test's finding
            problems.append(exc)

    threads = [threading.Thread(target=churn), *(threading.Thread(target=read) for _ in range(2))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: an unlocked iteration then meets a resize
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        sys.setswitchinterval(interval)
    assert problems == []
    for name in [n for n in pool.names() if n.startswith("churn")]:
        pool.unload(name)


def test_bound_keys_never_act_as_admins(root: Path) -> None:
    """Without admin keys, admin routes are open to unbound keys only (a single operator), never to tenants."""
    settings = ServeSettings(model="tiny", run_dir=root / "run", adapter_root=root, api_keys=[USER],
                             key_bindings=root / "bindings.json", allow_runtime_lora=True)
    with ready_client(settings) as client:
        load = {"lora_name": "mine", "lora_path": "extra"}
        error(client.post("/v1/load_lora_adapter", json=load, headers=auth(SORTING)), 403)
        error(client.get("/v1/run/files", headers=auth(SORTING)), 403)
        assert client.post("/v1/load_lora_adapter", json=load, headers=auth(USER)).status_code == 200


def test_fedmosaic_serve_honours_keys_from_the_environment(tmp_path: Path) -> None:
    """Issue 15's first finding, as a user runs it: FEDMOSAIC_SERVE_API_KEYS='["k"]' fedmosaic serve ..."""
    import os
    import subprocess

    import httpx

    port = free_port()
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "FEDMOSAIC_SERVE_API_KEYS": '["k"]',
           "FEDMOSAIC_SERVE_ADMIN_KEYS": "root-key", "FEDMOSAIC_SERVE_FEDDPA_ROUTING": "fixed"}
    proc = subprocess.Popen([sys.executable, "-m", "fedmosaic.cli", "serve", "--model", "tiny", "--port", str(port)],
                            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=auth("k"), timeout=5).status_code == 200
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=auth("k"),
                          timeout=5).status_code == 403
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=auth("root-key"),
                          timeout=5)  # runtime loading is on (an admin key exists); there is no such adapter
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
