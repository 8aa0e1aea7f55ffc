"""Issue 44 items 3 and 5 against a live uvicorn server run as ``fedmosaic serve`` runs it.

Malformed adapter configs are 400s that keep the client's keep-alive connection; files of an adapter
folder are checked like the folder; a silent connection or a slow body is cut off; a key sent in the
query string never reaches the access log; the over-long prompt error of completions names ``prompt``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from models import tiny_llama
from serving.api import create_app
from serving.api.server import uvicorn_options
from serving.cli import add_serve_arguments, settings_from_args
from serving.settings import ServeSettings
from tests.serving.helpers import free_port, write_adapter

ADMIN = "sk-admin-limits"
BAD = {"r-null": {"r": None}, "r-float": {"r": 8.9}, "alpha-list": {"lora_alpha": [1]},
       "targets-int": {"target_modules": 5}}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("limits")
    root = base / "adapters"
    good = write_adapter(tiny_llama(), root / "good", seed=3)
    for name, change in BAD.items():
        shutil.copytree(good, root / name)
        config = json.loads((good / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
    shutil.copytree(good, root / "deep")
    (root / "deep" / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    outside = base / "outside"  # a folder beside the adapter root, with a valid adapter in it
    shutil.copytree(good, outside)
    (root / "linked").mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "linked" / f).symlink_to(outside / f)
    return root


@pytest.fixture(scope="module")
def port(root: Path, live_server: Callable[..., str]) -> int:
    port = free_port()
    settings = ServeSettings(model="tiny", adapter_root=root, admin_keys=[ADMIN], max_model_len=64, port=port,
                             header_timeout_s=0.5, body_timeout_s=0.5)
    live_server(settings, log_level="info", log_config=None, **uvicorn_options(settings))
    return port


def request(port: int, method: str, path: str, body: dict | None = None,
            conn: http.client.HTTPConnection | None = None) -> tuple[int, dict]:
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    reply = conn.getresponse()
    data = reply.read()
    return reply.status, json.loads(data) if data.startswith(b"{") else {"text": data.decode()}


def test_malformed_adapter_configs_are_400_naming_the_field_on_a_kept_connection(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.connect()
    sock = conn.sock
    for name, field in [("r-null", "'r'"), ("r-float", "'r'"), ("alpha-list", "'lora_alpha'"),
                        ("targets-int", "'target_modules'"), ("deep", "nests deeper")]:
        status, body = request(port, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name}, conn)
        assert status == 400 and field in body["error"]["message"], (name, body)
        assert conn.sock is sock  # the same connection answered, and stays open for the next request
    assert request(port, "GET", "/health", conn=conn)[0] == 200
    assert conn.sock is sock
    assert request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": "good"}, conn)[0] == 200


def test_a_file_symlinked_out_of_the_adapter_root_is_refused(port: int) -> None:
    status, body = request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "linked", "lora_path": "linked"})
    assert status == 403 and body["error"]["code"] == "path_not_allowed", body
    assert "outside the adapter root" in body["error"]["message"]


def test_a_silent_connection_is_closed_and_a_slow_body_is_refused(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
        assert silent.recv(1) == b""  # closed by the server, not by this timeout
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\nAuthorization: Bearer " + ADMIN.encode() + b"\r\n\r\n{\"model\"")
        head = slow.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head


def test_a_key_in_the_query_string_never_reaches_the_access_log(port: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models?api_key=sk-secret-in-query&x=1")
        assert conn.getresponse().status == 401
        for _ in range(200):  # the access line is logged once the response went out
            if any("/v1/models" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any("/v1/models" in line for line in lines) and not any("sk-secret" in line for line in lines), lines


def test_the_over_long_prompt_error_names_the_endpoints_field(port: int) -> None:
    long = "word " * 200
    status, body = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": long, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = request(port, "POST", "/v1/chat/completions",
                           {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": long}]})
    assert status == 400 and body["error"]["param"] == "messages", body


def test_an_unexpected_exception_is_a_500_envelope_that_ends_in_the_app() -> None:
    app = create_app(ServeSettings(model="tiny"))

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    # raise_server_exceptions: the exception would surface here if it left the app (uvicorn then closes the
    # client's connection after the 500, the review's F5)
    reply = TestClient(app).get("/boom")
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    assert "a bug" not in reply.text


def test_limits_are_settable_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_arguments(sub)
    args = parser.parse_args(["serve", "--model", "tiny", "--header-timeout", "3", "--body-timeout", "4",
                              "--keep-alive", "6", "--max-connections", "7", "--max-header-bytes", "4096"])
    options = uvicorn_options(settings_from_args(args))
    assert (options["timeout_keep_alive"], options["limit_concurrency"], options["h11_max_incomplete_event_size"],
            options["http"].header_timeout_s) == (6, 7, 4096, 3.0)
