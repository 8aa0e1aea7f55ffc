"""The demo's HTTP client and handlers against the quick start's live server (tiny FedDPA-T run)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from demos.client import ApiClient, ApiError
from demos.handlers import CHAT, INSTRUCTION, Handlers
from tests.demos.conftest import API_KEY, Stack


@pytest.fixture()
def client(stack: Stack) -> Iterator[ApiClient]:
    api = ApiClient(stack.api + "/v1", API_KEY, timeout=120)
    yield api
    api.close()


def test_models_and_auth(client: ApiClient, stack: Stack) -> None:
    assert client.base_url == stack.api and client.health()
    models = {m.id: m for m in client.models()}
    assert models["tiny"].kind == "base" and models["global"].kind == "adapter"
    assert models["sorting"].kind == "feddpa" and models["sorting:local"].details["loaded"] is True
    with pytest.raises(ApiError) as caught:
        ApiClient(stack.api).models()
    assert caught.value.status == 401 and caught.value.code == "unauthorized"
    assert "HTTP 401, unauthorized" in str(caught.value)


def test_streamed_answers_carry_the_feddpa_weight(client: ApiClient) -> None:
    for instruction in (True, False):
        updates = list(client.stream("sorting", "Sort these words: pear apple fig", max_tokens=6,
                                     instruction=instruction))
        texts = [u.text for u in updates]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # the answer only grows
        last = updates[-1]
        assert last.finish_reason in ("stop", "length") and all(u.extension is None for u in updates[:-1])
        ext = last.extension
        assert ext is not None and ext["mode"] == "feddpa"
        weights, info = ext["weights"], ext["info"]
        assert set(weights) == {"global", "sorting:local"} and weights["sorting:local"] == pytest.approx(info["a"])
        assert weights["global"] + weights["sorting:local"] == pytest.approx(1.0)
        # the calibrated rule (the default once training wrote the calibration, #19): lambda times the
        # score's position between the background level (a = 0) and the client's own level (a = lambda)
        assert info["weighting"] == "calibrated"
        span = max(info["own"] - info["background"], 1e-6)
        assert info["a"] == pytest.approx(info["lambda"] * min(max((info["score"] - info["background"]) / span, 0), 1))
    single = client.answer("global", "Hi", max_tokens=3)
    assert single.extension == {"mode": "adapter", "weights": {"global": 1.0}, "info": {}}


def test_api_errors_come_back_with_status_and_code(client: ApiClient, stack: Stack) -> None:
    with pytest.raises(ApiError) as caught:
        client.answer("nobody", "Hi")
    assert caught.value.status == 404 and caught.value.code == "model_not_found" and "nobody" in caught.value.message
    with pytest.raises(ApiError) as caught:
        client.answer("global", "Hi", temperature=9)
    assert caught.value.status == 400 and caught.value.code == "invalid_request"
    with pytest.raises(ApiError) as caught:
        ApiClient("http://127.0.0.1:9", timeout=2).models()
    assert caught.value.status is None and "cannot reach" in str(caught.value)


def test_load_unload_and_run_files(client: ApiClient) -> None:
    assert "Success" in client.load_adapter("extra", "adapters/global")
    assert "extra" in [m.id for m in client.models()]
    with pytest.raises(ApiError) as caught:
        client.load_adapter("extra", "adapters/global")
    assert caught.value.code == "adapter_exists"
    assert "removed" in client.unload_adapter("extra")
    with pytest.raises(ApiError) as caught:
        client.unload_adapter("extra")
    assert caught.value.status == 404
    files = {f["path"]: f for f in client.run_files()}
    assert "eval/table.md" in files and files["eval/table.md"]["media_type"].startswith("text/markdown")
    assert "Personalization" in client.run_file("eval/table.md").decode()
    with pytest.raises(ApiError) as caught:
        client.run_file("eval/../run.json")
    assert caught.value.status == 403 and caught.value.code == "path_not_allowed"


def test_handlers_chat_compare_adapters_evaluation(client: ApiClient) -> None:
    h = Handlers(client)
    status, target, compare_client, unload, rows = h.refresh()
    assert "8 FedDPA clients" in status and len(compare_client["choices"]) == 8
    assert target["value"] in compare_client["choices"]  # a client is the first choice
    assert ["tiny", "base model, no adapter"] == rows[0][:2] and unload["choices"][0] == "global"
    *_, (history, box, route, ext, heat) = list(h.chat("Sort: b a", [], "sorting", INSTRUCTION, 5, 0.0))
    assert box == "" and [m["role"] for m in history] == ["user", "assistant", "assistant"]
    assert history[-1]["metadata"]["title"].startswith("⚖️ sorting: FedDPA a = ")
    assert "FedDPA weight a = " in route and ext["mode"] == "feddpa" and heat["visible"] is False
    # chat mode sends the conversation (without the routing notes) through the chat template
    *_, (history, _, route, _, _) = list(h.chat("And again", history, "sorting", CHAT, 4, 0.0))
    assert len(history) == 6 and "instance-wise" in route
    *_, (history, _, route, ext, _) = list(h.chat("Hi", [], "nobody", INSTRUCTION, 4, 0.0))
    assert history[-1]["content"].startswith("⚠️ API error — HTTP 404, model_not_found") and "404" in route
    g, local, combined, how = h.compare("sorting", "Sort: b a", INSTRUCTION, 4, 0.0)
    assert all(isinstance(t, str) and t for t in (g, local, combined)) and "FedDPA weight a = " in how
    message, *_ = h.load_adapter("", "", False, False, None)
    assert message.startswith("⚠️")
    message, *_ = h.load_adapter("x", "../elsewhere", False, False, None)
    assert "HTTP 403, path_not_allowed" in message
    tables, plots, note = h.evaluation()
    assert "Test-Time Personalization" in tables and plots and "plots from the served run" in note
