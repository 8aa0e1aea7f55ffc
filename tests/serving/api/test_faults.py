"""Issue 14 over HTTP: poison requests get 4xx and the next request works; a dead engine means 503 + exit 70."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from serving.settings import ServeSettings
from tests.serving.helpers import free_port, ready_client, wait_healthy

NORMAL = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "temperature": 0}
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def client() -> Iterator[TestClient]:
    settings = ServeSettings(model="tiny", exit_on_engine_failure=False, max_tokens_limit=64)
    with ready_client(settings) as client:
        yield client


@pytest.mark.parametrize("body", [
    {"temperature": 1e-45},
    {"temperature": 5e-324, "stream": True},
    {"seed": 1180591620717411303424},
    {"prompt": "a lone surrogate \ud800"},
    {"stop": ["x" * 300]},
    {"prompt": [[1, 2, 3]]},
])
def test_poison_requests_get_4xx_or_200_and_the_next_request_succeeds(client: TestClient, body: dict) -> None:  # type: ignore[type-arg]
    response = client.post("/v1/completions", content=json.dumps({**NORMAL, **body}),
                           headers={"Content-Type": "application/json"})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "BadRequestError"
    after = client.post("/v1/completions", json=NORMAL)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_dead_engine_answers_in_flight_requests_and_health_turns_503(client: TestClient) -> None:
    engine = client.app.state.server.engine  # type: ignore[attr-defined]
    original = engine._admit

    def bug(finished: object) -> None:
        raise KeyError("scheduler bug")

    engine._admit = bug
    try:
        response = client.post("/v1/completions", json=NORMAL)
        assert response.status_code in (500, 503)
        health = client.get("/health")
        assert health.status_code == 503 and "scheduler bug" in health.json()["error"]["message"]
        refused = client.post("/v1/completions", json=NORMAL)
        assert refused.status_code == 503
    finally:
        engine._admit = original
        engine.restart()
    assert client.get("/health").status_code == 200


def test_the_server_process_exits_70_when_its_engine_dies(tmp_path: Path) -> None:
    """A real uvicorn server whose engine breaks on the first step: the request gets 500, the process exits 70."""
    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import uvicorn
        from serving.api import create_app
        from serving.engine import Engine
        from serving.settings import ServeSettings

        def broken_admit(self, finished):
            raise MemoryError("simulated device out of memory")

        Engine._admit = broken_admit  # the engine thread dies at its first step
        uvicorn.run(create_app(ServeSettings(model="tiny")), host="127.0.0.1", port={port}, log_level="warning")
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        response = httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=30)
        assert response.status_code == 500 and "request" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert proc.wait(timeout=30) == 70
    finally:
        if proc.poll() is None:
            proc.kill()
