"""Structured output and tools against a real server process, through the clients people use.

The ``openai`` SDK's ``chat.completions.parse`` with a pydantic model, ``langchain-openai``'s
``with_structured_output`` and ``bind_tools``, streamed tool calls, and the 400s (OpenAI's envelope) for
what cannot be served. The served model is the tiny random one: under a grammar even it answers valid
JSON, which is what these tests check (schemas with bounded values, so an answer ends within the limit).
Routed targets (a FedDPA client, an AMoLE client) decode under the same grammar.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from models.tiny import tiny_tokenizer
from serving.openai import builders
from serving.openai.schemas import ChatCompletionRequest
from serving.settings import ServeSettings
from tests.serving.helpers import ready_client
from tests.serving.test_amole_serving import write_amole

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: dict[str, Any] = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                           "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


class Verdict(BaseModel):
    label: Literal["positive", "negative"]
    confident: bool
    stars: int = Field(ge=1, le=5)


class WeatherArgs(BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


@tool(args_schema=WeatherArgs)
def get_weather(unit: str, days: int) -> str:
    """Get the forecast for the next days."""
    return f"{days} days in {unit}"


@pytest.fixture(scope="module")
def url(live_server: Callable[..., str]) -> str:
    return live_server(ServeSettings(model="tiny", dtype="float32"))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 200, **body})


def test_the_sdks_parse_returns_the_pydantic_object(url: str) -> None:
    completion = client(url).chat.completions.parse(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                                    response_format=Verdict, temperature=0, max_tokens=200)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Verdict)
    assert Verdict.model_validate_json(message.content or "") == message.parsed


def test_json_object_and_a_non_strict_schema_are_json(url: str) -> None:
    body = post(url, response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": {**WEATHER, "uniqueItems": True}, "strict": False}}).json()  # ignored when not strict
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), WEATHER)
    body = post(url, response_format={"type": "json_object"}, max_tokens=400, temperature=0.8, seed=3).json()
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may write one long number: the prefix is still JSON's
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert choice["message"]["content"].startswith("{")


def test_langchain_with_structured_output(url: str) -> None:
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="tiny", temperature=0, max_tokens=200,  # type: ignore[arg-type]
                     max_retries=0)
    answer = llm.with_structured_output(Verdict).invoke("Is this review positive? 'Great food.'")
    assert isinstance(answer, Verdict)


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_langchain_bind_tools_calls_the_tool(url: str, choice: str) -> None:
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="tiny", temperature=0, max_tokens=200,  # type: ignore[arg-type]
                     max_retries=0)
    reply = llm.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Paris for three days?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"  # type: ignore[attr-defined]
    WeatherArgs.model_validate(reply.tool_calls[0]["args"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_come_back_in_openais_shape(url: str, tool_choice: Any) -> None:
    body = post(url, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", body
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if isinstance(tool_choice, dict):
        assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_streamed_tool_calls_accumulate_as_the_sdk_reads_them(url: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    plain = post(url, tools=TOOLS, tool_choice=named).json()["choices"][0]["message"]["tool_calls"]
    stream = client(url).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                                 tool_choice=named, temperature=0, max_tokens=200, stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""  # type: ignore[union-attr]
            entry["arguments"] += part.function.arguments or ""  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in plain]


def test_a_history_with_tool_calls_and_tool_results_is_accepted(url: str) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"unit": "celsius", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    body = post(url, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8).json()
    assert "tool_calls" not in body["choices"][0]["message"]
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": history, "tools": TOOLS})
    [choice] = builders.choices(request, tiny_tokenizer(), builders.Limits())
    assert choice.calls and choice.prompt is not None
    call = '<tool_call>{"name": "get_weather", "arguments": {"unit": "celsius", "days": 1}}</tool_call>'
    assert call in choice.prompt
    assert "sunny, 21 C" in choice.prompt and json.dumps(TOOLS[1]["function"]) in choice.prompt  # the preamble


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}}}}, "response_format",
     "'multipleOf' at response_format.json_schema.schema.properties.a"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "together with tools"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "min_tokens"),
])
def test_what_cannot_be_served_is_a_400_naming_it(url: str, body: dict[str, Any], param: str, words: str) -> None:
    response = post(url, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "BadRequestError"


def test_the_sdk_raises_the_400(url: str) -> None:
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client(url).chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                            response_format={"type": "json_schema"})  # type: ignore[typeddict-item]


@pytest.fixture(scope="module")
def amole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("amole") / "run"
    write_amole(run / "adapters" / "amole", seed=0)
    (run / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    return run


@pytest.mark.parametrize(("kind", "targets"), [("feddpa", ("sorting", "capitals")), ("amole", ("c0", "c1"))])
def test_routed_targets_decode_under_the_grammar(kind: str, targets: tuple[str, ...], request: pytest.FixtureRequest
                                                 ) -> None:
    schema = Verdict.model_json_schema()
    run = request.getfixturevalue("feddpa_run" if kind == "feddpa" else "amole_run")
    with ready_client(ServeSettings(model="tiny", run_dir=run)) as http:
        for target in targets:
            body = http.post("/v1/chat/completions", json={
                "model": target, "messages": MESSAGES, "temperature": 0, "max_tokens": 200, "n": 2, "seed": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}}).json()
            assert body["fedmosaic"]["mode"] == kind, body
            for choice in body["choices"]:
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
