"""vLLM's tolerance and defaults, and the endpoints clients probe, against a live uvicorn server.

Unknown fields are ignored with one warning per name (``--strict-fields``: 400); ``best_of`` keeps the
candidates with the highest cumulative log-probability (checked against the same candidates asked for
with ``n``); ``generation_config.json`` supplies what a request leaves unset (``vllm``: nothing);
``/tokenize`` and ``/detokenize`` round-trip prompts and chat messages; CORS preflights, the base
model's aliases, ``/v1/models/{id}``, ``/version`` and ``/ping``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.settings import ServeSettings

ORIGIN = "http://ui.example"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    return folder


def settings(**given: Any) -> ServeSettings:
    return ServeSettings(model="tiny", dtype="float32", max_tokens_limit=32, default_max_tokens=5, **given)


@pytest.fixture(scope="module")
def url(live_server: Callable[..., str], gen_dir: Path) -> str:
    return live_server(settings(served_model_name="tiny", model_aliases=["tiny-alias"], allowed_origins=[ORIGIN],
                                generation_config=str(gen_dir)))


@pytest.fixture(scope="module")
def strict_url(live_server: Callable[..., str]) -> str:
    return live_server(settings(strict_fields=True, generation_config="vllm"))


def post(url: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def test_unknown_fields_are_ignored_with_one_warning_per_name(url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="serving.openai.compat"):
        for _ in range(2):
            body = post(url, "/v1/chat/completions", model="tiny", messages=[{**CHAT[0], "weight": 1}], max_tokens=2,
                        guided_choice=["a"], top_a=0.1).json()
            assert body["choices"][0]["message"]["role"] == "assistant"
        post(url, "/v1/completions", model="tiny", prompt="Hi", max_tokens=2, top_a=0.2, mirostat=1).raise_for_status()
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sorted(warned) == sorted(f"ignoring the unknown request field {name!r} (warned once per field name; "
                                    "--strict-fields refuses such requests)"
                                    for name in ("guided_choice", "top_a", "messages.weight", "mirostat"))


def test_strict_fields_refuses_an_unknown_field_by_name(strict_url: str) -> None:
    problem = error(post(strict_url, "/v1/chat/completions", model="tiny", messages=CHAT, top_a=0.1), 400)
    assert problem["param"] == "top_a" and "--strict-fields" in problem["message"]
    problem = error(post(strict_url, "/v1/chat/completions", model="tiny", messages=[{**CHAT[0], "x": 1}]), 400)
    assert problem["param"] == "messages.x"
    assert post(strict_url, "/v1/completions", model="tiny", prompt="Hi", max_tokens=2, min_p=0.1,
                top_k=5, repetition_penalty=1.1, stop_token_ids=[3]).status_code == 200


def test_best_of_answers_the_candidates_with_the_highest_cumulative_logprob(url: str) -> None:
    common = {"model": "tiny", "prompt": "The sky is", "max_tokens": 6, "temperature": 1.0, "seed": 7,
              "ignore_eos": True}
    # the same four candidates: choice j of a prompt samples with seed + j either way
    candidates = post(url, "/v1/completions", n=4, logprobs=0, **common).json()["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in candidates]
    ranked = [candidates[i]["text"] for i in sorted(range(4), key=lambda i: -scores[i])]
    assert len(set(ranked)) > 1, "the candidates should differ for the test to mean anything"
    best = post(url, "/v1/completions", n=2, best_of=4, **common).json()
    assert [c["text"] for c in best["choices"]] == ranked[:2]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for: not shown
    assert error(post(url, "/v1/completions", model="tiny", prompt="x", n=3, best_of=2), 400)["param"] == "best_of"
    problem = error(post(url, "/v1/completions", model="tiny", prompt="x", best_of=2, stream=True), 400)
    assert problem["param"] == "best_of" and "stream" in problem["message"]


def test_generation_config_supplies_unset_fields_and_the_request_overrides_them(url: str, strict_url: str) -> None:
    def chat(base: str, **extra: Any) -> dict[str, Any]:
        response = post(base, "/v1/chat/completions", model="tiny", messages=CHAT, ignore_eos=True, **extra)
        response.raise_for_status()
        return dict(response.json())

    # the folder's max_new_tokens 3 and temperature 0 (greedy: the same text every time, no seed)
    first, second = chat(url), chat(url)
    assert first["usage"]["completion_tokens"] == 3
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert chat(url, temperature=None)["choices"][0]["message"] == first["choices"][0]["message"]  # null: default
    assert chat(url, max_tokens=4)["usage"]["completion_tokens"] == 4
    greedy = chat(url, max_tokens=3, temperature=0)["choices"][0]["message"]
    assert greedy == first["choices"][0]["message"]
    # --generation-config vllm: the server's default max_tokens (5) and vLLM's temperature 1
    assert chat(strict_url)["usage"]["completion_tokens"] == 5


def test_min_p_and_vllm_fields_are_served(url: str) -> None:
    greedy = post(url, "/v1/completions", model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                  ignore_eos=True).json()
    # min_p 1 keeps the most likely token alone: sampling at temperature 1 is then greedy
    sampled = post(url, "/v1/completions", model="tiny", prompt="Hi", max_tokens=4, temperature=1.0, min_p=1.0,
                   ignore_eos=True, seed=3).json()
    assert sampled["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert error(post(url, "/v1/completions", model="tiny", prompt="Hi", min_p=1.5), 400)["param"] == "min_p"


def test_chat_template_controls(url: str) -> None:
    history = [*CHAT, {"role": "assistant", "content": "The colour is"}]
    opened = post(url, "/tokenize", model="tiny", messages=CHAT).json()
    closed = post(url, "/tokenize", model="tiny", messages=CHAT, add_generation_prompt=False).json()
    text = post(url, "/detokenize", model="tiny", tokens=opened["tokens"]).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n")
    assert post(url, "/detokenize", tokens=closed["tokens"]).json()["prompt"] == text.removesuffix(
        "<|im_start|>assistant\n")
    continued = post(url, "/tokenize", messages=history, add_generation_prompt=False,
                     continue_final_message=True).json()
    assert post(url, "/detokenize", tokens=continued["tokens"]).json()["prompt"].endswith("The colour is")
    body = post(url, "/v1/chat/completions", model="tiny", messages=history, add_generation_prompt=False,
                continue_final_message=True, max_tokens=2).json()
    assert body["usage"]["prompt_tokens"] == continued["count"]
    problem = error(post(url, "/v1/chat/completions", model="tiny", messages=history, continue_final_message=True),
                    400)
    assert problem["param"] == "continue_final_message"
    problem = error(post(url, "/v1/chat/completions", model="tiny", messages=CHAT,
                         chat_template_kwargs={"tokenize": True}), 400)
    assert problem["param"] == "chat_template_kwargs" and "tokenize" in problem["message"]


def test_tokenize_and_detokenize_round_trip(url: str) -> None:
    prompt = "The capital of France is Paris."
    tokens = post(url, "/tokenize", model="tiny", prompt=prompt, return_token_strs=True).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] > 0
    assert post(url, "/detokenize", model="tiny", tokens=tokens["tokens"]).json() == {"prompt": prompt}
    usage = post(url, "/v1/completions", model="tiny", prompt=prompt, max_tokens=1).json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]  # the count is what a completion of it costs
    chat = post(url, "/tokenize", model="tiny-alias", messages=CHAT).json()
    usage = post(url, "/v1/chat/completions", model="tiny", messages=CHAT, max_tokens=1).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    assert error(post(url, "/detokenize", tokens=[0, 10**6]), 400)["param"] == "tokens"
    assert error(post(url, "/tokenize", model="nope", prompt="x"), 404)["type"] == "NotFoundError"
    assert post(url, "/tokenize", prompt="x", messages=CHAT).status_code == 400


def test_aliases_and_retrieving_a_model(url: str) -> None:
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in listed][:2] == ["tiny", "tiny-alias"]
    card = httpx.get(f"{url}/v1/models/tiny-alias").json()
    assert card["id"] == "tiny-alias" and card["root"] == "tiny" and card["fedmosaic"]["alias_of"] == "tiny"
    assert httpx.get(f"{url}/v1/models/tiny").json() == listed[0]
    assert error(httpx.get(f"{url}/v1/models/nope/deeper"), 404)["type"] == "NotFoundError"
    body = post(url, "/v1/chat/completions", model="tiny-alias", messages=CHAT, max_tokens=1).json()
    assert body["model"] == "tiny-alias" and body["fedmosaic"]["mode"] == "base"


def test_cors_preflight_and_probes(url: str, strict_url: str) -> None:
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
    preflight = httpx.options(f"{url}/v1/chat/completions", headers=asked)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    simple = httpx.get(f"{url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{url}/v1/chat/completions", headers={**asked, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    closed = httpx.options(f"{strict_url}/v1/chat/completions", headers=asked)  # no --allowed-origins
    assert closed.status_code == 405 and "access-control-allow-origin" not in closed.headers
    version = httpx.get(f"{url}/version").json()["version"]
    assert isinstance(version, str) and version
    assert httpx.get(f"{url}/ping").json() == httpx.get(f"{url}/health").json() == {"status": "ok"}
