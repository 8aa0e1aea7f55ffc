"""Issue 15 item 4 over HTTP: prompt forms, n, logprobs, echo and the new sampling parameters, each against
a reference computed from the served model itself (float32, tiny model): log-probabilities equal
``log_softmax`` of a teacher-forced forward, penalties equal a naive greedy loop over full forwards."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from serving.settings import ServeSettings
from tests.serving.helpers import ready_client

PROMPT = "The capital of France is Paris and the capital of Italy is"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with ready_client(ServeSettings(model="tiny", dtype="float32", max_tokens_limit=32)) as client:
        yield client


def engine(client: TestClient) -> Any:
    return client.app.state.server.engine  # type: ignore[attr-defined]


def ids_of(client: TestClient, text: str) -> list[int]:
    return list(engine(client).tokenizer(text, add_special_tokens=False)["input_ids"])


def text_of(client: TestClient, token: int) -> str:
    return str(engine(client).tokenizer.decode([token], skip_special_tokens=False))


def logp(client: TestClient, ids: list[int]) -> torch.Tensor:
    """(T, V) log-probabilities of a teacher-forced forward of the served (base) model."""
    with torch.inference_mode():
        return torch.log_softmax(engine(client).model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def greedy(client: TestClient, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(logp(client, prompt + out)[-1])))
    return out


def test_completion_logprobs_are_the_models_log_softmax(client: TestClient) -> None:
    prompt = ids_of(client, PROMPT)
    body = complete(client, prompt=prompt, max_tokens=5, ignore_eos=True, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    generated = greedy(client, prompt, 5)
    assert lp["tokens"] == [text_of(client, t) for t in generated]
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    for i, token in enumerate(generated):
        ref = logp(client, prompt + generated[:i])[-1]
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[token]), abs=1e-4)
        top = torch.topk(ref, 3)
        want = {text_of(client, int(t)): float(v) for t, v in zip(top.indices, top.values, strict=True)}
        assert set(lp["top_logprobs"][i]) == set(want) | {lp["tokens"][i]}
        for key, value in want.items():
            assert lp["top_logprobs"][i][key] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("as_ids", [True, False])
def test_echo_prompt_logprobs_equal_a_teacher_forced_forward(client: TestClient, as_ids: bool) -> None:
    prompt = ids_of(client, PROMPT)
    body = complete(client, prompt=prompt if as_ids else PROMPT, max_tokens=1, logprobs=1, echo=True)
    choice, ref = body["choices"][0], logp(client, prompt)
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(prompt)):
        assert lp["tokens"][j] == text_of(client, prompt[j])
        assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)
        best = int(torch.argmax(ref[j - 1]))
        assert lp["top_logprobs"][j][text_of(client, best)] == pytest.approx(float(ref[j - 1, best]), abs=1e-4)
    assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)  # the greedy next token


def test_chat_logprobs_and_top_logprobs(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Name a colour"}]
    body = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 2}).json()
    templated = engine(client).tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = ids_of(client, templated)
    generated = greedy(client, prompt, 4)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [text_of(client, t) for t in generated]
    for i, entry in enumerate(content):
        ref = logp(client, prompt + generated[:i])[-1]
        assert entry["logprob"] == pytest.approx(float(ref[generated[i]]), abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())
        top = torch.topk(ref, 2)
        assert [t["token"] for t in entry["top_logprobs"]] == [text_of(client, int(t)) for t in top.indices]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                       "logprobs": True}).json()
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    refused = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "top_logprobs": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


def same(a: Any, b: Any) -> bool:
    """Equal JSON, floats within 1e-4 (a streamed request may share its batch with other rows)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def events(response: Any) -> list[dict[str, Any]]:
    raw = "".join(response.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]


def test_streamed_logprobs_concatenate_to_the_plain_response(client: TestClient) -> None:
    body = {"model": "tiny", "prompt": [PROMPT, "Hello"], "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "echo": True, "n": 2}
    plain = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = events(response)
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert same([c["logprobs"] for c in mine if c["logprobs"]], [choice["logprobs"]])
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 1}
    plain = client.post("/v1/chat/completions", json=chat).json()
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
        chunks = events(response)
    content = [e for c in chunks for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert same(content, plain["choices"][0]["logprobs"]["content"])


def test_prompt_forms_and_batches(client: TestClient) -> None:
    a, b = PROMPT, "Sort these words: pear, apple"
    single = [complete(client, prompt=p, max_tokens=4)["choices"][0]["text"] for p in (a, b)]
    assert complete(client, prompt=[a], max_tokens=4)["choices"][0]["text"] == single[0]
    assert complete(client, prompt=ids_of(client, a), max_tokens=4)["choices"][0]["text"] == single[0]
    for prompt in ([a, b], [ids_of(client, a), ids_of(client, b)]):
        body = complete(client, prompt=prompt, max_tokens=4)
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == single
        assert body["usage"]["prompt_tokens"] == len(ids_of(client, a)) + len(ids_of(client, b))
    echoed = complete(client, prompt=[ids_of(client, b)], max_tokens=2, echo=True)["choices"][0]["text"]
    assert echoed.startswith(b)


def test_n_choices_with_derived_seeds(client: TestClient) -> None:
    body = complete(client, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=41, ignore_eos=True)
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    for j, text in enumerate(texts):  # choice j samples with seed + j (vLLM's rule)
        alone = complete(client, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=41 + j, ignore_eos=True)
        assert alone["choices"][0]["text"] == text
    assert [c["text"] for c in complete(client, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=41,
                                        ignore_eos=True)["choices"]] == texts
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == len(ids_of(client, PROMPT))
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                      "n": 2, "max_tokens": 3, "temperature": 0}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1] and all("fedmosaic" in c for c in chat["choices"])


def naive(client: TestClient, prompt: list[int], n: int, *, presence: float = 0.0, frequency: float = 0.0,
          repetition: float = 1.0, bias: dict[int, float] | None = None, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy over full forwards with the processors applied by hand (OpenAI's and CTRL's formulas)."""
    out: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            raw = engine(client).model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        logits = raw.clone()  # a normal tensor, edited below
        for t, v in (bias or {}).items():
            logits[t] += v
        for t in set(prompt) | set(out) if repetition != 1.0 else ():
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, c in Counter(out).items():
            logits[t] -= frequency * c + presence
        out.append(int(torch.argmax(logits)))
        if out[-1] in stop_ids:
            break
    return out


@pytest.mark.parametrize(("fields", "reference"), [
    ({"presence_penalty": 1.5}, {"presence": 1.5}),
    ({"frequency_penalty": 2.0}, {"frequency": 2.0}),
    ({"repetition_penalty": 3.0}, {"repetition": 3.0}),
    ({"logit_bias": {"7": 9.0, "11": -100}}, {"bias": {7: 9.0, 11: -100.0}}),
])
def test_penalties_and_logit_bias_equal_a_naive_loop(client: TestClient, fields: dict[str, Any],
                                                     reference: dict[str, Any]) -> None:
    prompt = ids_of(client, PROMPT)
    body = complete(client, prompt=prompt, max_tokens=10, ignore_eos=True, logprobs=0, **fields)
    want = naive(client, prompt, 10, **reference)
    assert body["choices"][0]["logprobs"]["tokens"] == [text_of(client, t) for t in want]
    assert want != naive(client, prompt, 10)  # the parameter changed the answer


def test_min_tokens_ignore_eos_and_stop_token_ids(client: TestClient) -> None:
    prompt = ids_of(client, PROMPT)
    eos = min(engine(client).eos_ids)
    forced = complete(client, prompt=prompt, max_tokens=10, logit_bias={str(eos): 100}, min_tokens=3)
    assert forced["usage"]["completion_tokens"] == 4 and forced["choices"][0]["finish_reason"] == "stop"
    ended = complete(client, prompt=prompt, max_tokens=10, logit_bias={str(eos): 100})
    assert ended["usage"]["completion_tokens"] == 1
    ignored = complete(client, prompt=prompt, max_tokens=10, logit_bias={str(eos): 100}, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 10 and ignored["choices"][0]["finish_reason"] == "length"
    free = naive(client, prompt, 10)
    stop = free[4]
    cut = complete(client, prompt=prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[stop], logprobs=0)
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["logprobs"]["tokens"] == [text_of(client, t) for t in free[: free.index(stop) + 1]]


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]), ("response_format", {"type": "json_schema"}),
    ("tool_choice", "auto"), ("store", True), ("audio", {"voice": "x"}), ("modalities", ["audio"]),
    ("logit_bias", {"x": 1}),
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
])
def test_fields_not_supported_are_refused_by_name(client: TestClient, field: str, value: Any) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field and field in error["message"]


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "min_tokens", True), ("/v1/completions", "max_tokens", "4"),
    ("/v1/completions", "max_tokens", 4.0), ("/v1/completions", "stream", 0), ("/v1/completions", "echo", "false"),
    ("/v1/completions", "logprobs", True), ("/v1/completions", "stop_token_ids", [True]),
    ("/v1/chat/completions", "logprobs", 1), ("/v1/chat/completions", "seed", False),
    ("/v1/chat/completions", "temperature", "0.5"),
])
def test_values_of_another_type_are_refused_not_coerced(client: TestClient, path: str, field: str,
                                                        value: Any) -> None:
    """The OpenAPI document's types hold: ``true`` is no integer, ``0`` no boolean, ``"4"`` no number."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


def test_completion_fields_refused_by_name_and_neutral_values_accepted(client: TestClient) -> None:
    for field, value in (("best_of", 200), ("suffix", "end"), ("prompt", []), ("prompt", [[]]), ("min_tokens", 50),
                         ("n", 100)):
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": image}]})
    assert response.status_code == 400 and "image_url" in response.json()["error"]["message"]
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "store": False,
               "user": "u-1", "metadata": {"k": "v"}, "parallel_tool_calls": True, "temperature": None,
               "n": None, "stream": False, "logprobs": False, "service_tier": "auto"}
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None, "annotations": []},
               {"role": "user", "content": [{"type": "text", "text": "Again"}], "name": "bob"}]
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "max_tokens": 2,
                                                          **neutral})
    assert response.status_code == 200, response.text
    assert complete(client, prompt="Hi", max_tokens=2, best_of=1, suffix=None, echo=False)["choices"]
