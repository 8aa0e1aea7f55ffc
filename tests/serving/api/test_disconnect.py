"""Issue 44 item 2: a client that hangs up before its (non-streamed) answer frees its engine rows at once.

The app is driven as uvicorn drives it (ASGI): the request body, then ``http.disconnect`` once the
request is generating. Before the fix the handler kept awaiting every choice, so an abandoned request
decoded to ``max_tokens`` holding its KV slot (the review's F3: 16 abandoned requests held all 8 slots).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient

from serving.engine import Engine, StepReport
from serving.settings import ServeSettings
from tests.serving.helpers import ready_client

LONG = {"model": "tiny", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
KINDS = {
    "completion": ("/v1/completions", {**LONG, "prompt": "Count with me: one two"}),
    "chat": ("/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": "Tell me a long story"}]}),
    "n=2": ("/v1/completions", {**LONG, "prompt": "Two answers please", "n": 2, "temperature": 1.0, "seed": 3}),
    "logprobs": ("/v1/completions", {**LONG, "prompt": "Score every token", "logprobs": 2, "echo": True}),
    "chat logprobs": ("/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": "Hi"}],
                                               "logprobs": True, "top_logprobs": 2}),
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServeSettings(model="tiny", max_batch_size=2, max_tokens_limit=512, prefix_cache_slots=0)
    with ready_client(settings) as client:
        yield client


async def abandon(app: Any, engine: Engine, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST ``body`` and hang up once the engine runs it; returns what the app sent."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    pending = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        while engine.stats().running == 0:  # the client gives up once its request runs (or the first of them does)
            await anyio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_abandoned_request_frees_its_slots_within_one_step(client: TestClient, kind: str) -> None:
    state = client.app.state.server  # type: ignore[attr-defined]
    engine: Engine = state.engine
    path, body = KINDS[kind]
    steps: list[StepReport] = []
    sent = client.portal.call(abandon, client.app, engine, path, body)  # type: ignore[union-attr]
    engine.step_observers.append(steps.append)  # from the moment the handler returned: its rows are cancelled
    try:
        assert not [m for m in sent if m["type"] == "http.response.start" and m["status"] == 200], \
            "the abandoned request was answered: it ran to max_tokens"
        for _ in range(2000):  # the engine's next step drops the cancelled rows
            if not engine.has_work():
                break
            time.sleep(0.005)
        assert engine.stats().running == 0 and engine.stats().waiting == 0
        assert engine.kv.free_slots == 2  # every slot is free again
        assert sum(1 for s in steps if s.decode_rows) <= 1  # at most the step already in flight decoded on
    finally:
        engine.step_observers.remove(steps.append)
    reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "Next", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_many_abandoned_requests_leave_the_server_free(client: TestClient) -> None:
    """The review's retry storm: more abandoned requests than slots, some still queued when they are abandoned."""
    engine: Engine = client.app.state.server.engine  # type: ignore[attr-defined]
    path, body = KINDS["completion"]

    async def storm() -> None:
        async with anyio.create_task_group() as group:
            for _ in range(5):
                group.start_soon(abandon, client.app, engine, path, body)

    steps: list[StepReport] = []
    engine.step_observers.append(steps.append)
    try:
        client.portal.call(storm)  # type: ignore[union-attr]
        for _ in range(2000):
            if not engine.has_work():
                break
            time.sleep(0.005)
    finally:
        engine.step_observers.remove(steps.append)
    assert sum(s.decode_rows for s in steps) < LONG["max_tokens"]  # not even one request decoded to its end
    assert engine.stats().running == 0 and engine.stats().waiting == 0 and engine.kv.free_slots == 2
    reply = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Next"}]})
    assert reply.status_code == 200
