"""HTTP API on the tiny model: OpenAI shapes, SSE framing, every error path, runtime adapters, openai client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from models import tiny_llama
from serving.api import create_app
from serving.api.app import in_own_thread
from serving.settings import ServeSettings
from tests.serving.helpers import free_port, ready_client, write_adapter, write_feddpa_run

KEY = "sk-test"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "The capital of France"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    tiny = tiny_llama()
    write_feddpa_run(root / "run", ("0", "1"), tiny)
    write_adapter(tiny, root / "extra", seed=5)
    write_adapter(tiny, root.parent / "outside", seed=6)
    return root


@pytest.fixture(scope="module")
def settings(root: Path) -> ServeSettings:
    return ServeSettings(model="tiny", run_dir=root / "run", adapter_root=root, admin_keys=[KEY], max_tokens_limit=64,
                         max_body_bytes=4096)


@pytest.fixture(scope="module")
def client(settings: ServeSettings) -> Iterator[TestClient]:
    with ready_client(settings, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def assert_error(response, status: int, code: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def test_health_is_503_while_loading(settings: ServeSettings) -> None:
    app = create_app(settings)  # no lifespan entered: nothing loaded
    bare = TestClient(app)
    assert_error(bare.get("/health"), 503, "not_ready")
    assert_error(bare.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}), 503)


def test_the_model_loads_in_a_thread_that_then_ends(client: TestClient) -> None:
    """Only the engine thread keeps an OpenMP team alive (a second long-lived one halves its speed)."""
    names = [t.name for t in threading.enumerate()]
    assert "fedmosaic-engine" in names and "fedmosaic-load" not in names


def test_in_own_thread_hands_back_the_result_and_the_exception() -> None:
    seen: list[str] = []

    def work(fail: bool) -> None:
        seen.append(threading.current_thread().name)
        if fail:
            raise ValueError("load failed")

    async def go() -> None:
        await in_own_thread(work, False)
        with pytest.raises(ValueError, match="load failed"):
            await in_own_thread(work, True)

    asyncio.run(go())
    assert seen == ["fedmosaic-load"] * 2
    assert "fedmosaic-load" not in [t.name for t in threading.enumerate()]


def test_health_and_models(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "global", "0:local", "1:local", "0", "1"]


def test_chat_shapes_and_feddpa_weights(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json={**CHAT, "model": "0", "temperature": 0}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["fedmosaic"]["mode"] == "feddpa"
    assert body["fedmosaic"]["weights"] == {"global": 0.75, "0:local": 0.25}


def test_mixture_extension_and_completions(client: TestClient) -> None:
    mix = [{"name": "global", "weight": 0.5}, {"name": "1:local", "weight": 0.5}]
    body = client.post("/v1/chat/completions", json={**CHAT, "adapters": mix}).json()
    assert body["fedmosaic"] == {"mode": "mixture", "weights": {"global": 0.5, "1:local": 0.5}, "info": {},
                                 "prompt_format": "alpaca_short"}  # the run's adapters: its trained template
    done = client.post("/v1/completions", json={"model": "global", "prompt": "Sort these", "max_tokens": 4,
                                                "temperature": 0}).json()
    assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] <= 4
    assert done["fedmosaic"]["weights"] == {"global": 1.0}


def test_sse_framing_ends_in_done(client: TestClient) -> None:
    with client.stream("POST", "/v1/chat/completions",
                       json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                                        "stream": True}) as response:
        assert "".join(response.iter_text()).endswith("data: [DONE]\n\n")


def test_error_paths(client: TestClient) -> None:
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404, "model_not_found")
    error = assert_error(client.post("/v1/chat/completions", json={**CHAT, "temperature": 5}), 400, "invalid_request")
    assert error["param"] == "temperature"
    assert_error(client.post("/v1/chat/completions", json={"model": "tiny"}), 400, "invalid_request")
    bad_json = client.post("/v1/chat/completions", content=b"{not", headers={"content-type": "application/json"})
    assert_error(bad_json, 400)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(client.post("/v1/chat/completions", json=big), 413, "request_too_large")
    error = assert_error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 65}), 400)
    assert error["param"] == "max_tokens"
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "n": 200}), 400)
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "adapters": [{"name": "nope", "weight": 1}]}), 404)
    assert_error(client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.get("/v1/models", headers={"Authorization": ""}), 401, "unauthorized")
    assert_error(client.get("/v1/nothing"), 404)


def test_runtime_load_and_unload(client: TestClient, root: Path) -> None:
    load = client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": "extra"})
    assert load.status_code == 200, load.text
    assert "extra" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    body = client.post("/v1/chat/completions", json={**CHAT, "model": "extra"}).json()
    assert body["fedmosaic"]["weights"] == {"extra": 1.0}
    assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": "extra"}), 400,
                 "adapter_exists")
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": "extra",
                                                      "load_inplace": True}).status_code == 200
    assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "../outside"}), 403,
                 "path_not_allowed")
    assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "missing"}), 400)
    # paths the OS cannot take: 400 naming the problem, never 500 (found by schemathesis on a live server)
    for path, why in (("~no-such-user-xyz", "names no home folder"), ("x" * 3000, "not a usable path"),
                      ("a\x00b", "not a usable path")):
        error = assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}), 400,
                             "adapter_load_failed")
        assert why in error["message"] and len(error["message"]) < 300  # the huge path is cut
    # vLLM's bodies with values of another type: refused, not coerced (0 is no boolean, false no integer)
    assert assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": "extra",
                                                                   "load_inplace": 0}), 400)["param"] == "load_inplace"
    assert assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "extra", "lora_int_id": False}),
                        400)["param"] == "lora_int_id"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "extra"}), 404)
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}), 404)


def test_metrics(client: TestClient) -> None:
    client.post("/v1/chat/completions", json={**CHAT, "model": "1"})
    text = client.get("/metrics").text
    for name in ("fedmosaic_requests_total", "fedmosaic_generation_tokens_total", "fedmosaic_queue_size",
                 "fedmosaic_request_latency_seconds_bucket", "fedmosaic_loaded_adapters",
                 "fedmosaic_feddpa_local_weight_count", "fedmosaic_time_to_first_token_seconds_bucket",
                 'fedmosaic_engine_step_seconds_count{kind="'):
        assert name in text
    counts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith('fedmosaic_time_to_first_token_seconds_count{endpoint="chat"}')]
    assert counts and counts[0] >= 1  # the module's client has served earlier chat requests too
    assert 'fedmosaic_feddpa_local_weight_bucket{le="0.3"}' in text


def test_metrics_count_computed_and_reused_prompt_tokens(client: TestClient) -> None:
    def value(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    names = ("fedmosaic_engine_prefill_tokens_total", "fedmosaic_engine_decode_rows_total",
             "fedmosaic_prefix_cache_hits_total", "fedmosaic_prefix_cache_reused_tokens_total")
    request = {**CHAT, "model": "global", "max_tokens": 2, "messages": [{"role": "user", "content": "Count to three."}]}
    client.post("/v1/chat/completions", json=request)
    before = client.get("/metrics").text
    body = client.post("/v1/chat/completions", json=request).json()  # the same prompt: its prefix is reused
    after = client.get("/metrics").text
    computed, rows, hits, reused = (value(after, n) - value(before, n) for n in names)
    prompt = body["usage"]["prompt_tokens"]
    assert hits == 1 and reused == prompt - 1 and computed == 1  # only the last prompt token is computed
    assert rows >= 1


def test_openai_client_against_uvicorn(settings: ServeSettings) -> None:
    openai = pytest.importorskip("openai")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                                  ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        for _ in range(300):
            try:
                sdk.models.list()
                break
            except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
                time.sleep(0.05)
        reply = sdk.chat.completions.create(model="0", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                            temperature=0)
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
        stream = sdk.chat.completions.create(model="global", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=5, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        again = sdk.chat.completions.create(model="global", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0)
        assert text == again.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    finally:
        server.should_exit = True
        thread.join(timeout=20)
    assert not thread.is_alive()
