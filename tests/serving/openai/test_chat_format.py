"""Chat requests to a run's targets in the prompt format its adapters trained with (docs/serving.md).

A chat request equivalent to a record must reach the engine as exactly the token ids training and
``fedmosaic eval`` render for that record (``training.data.prompts``); system and earlier turns go into the
context; the base model, adapters from outside the run and a run trained on the chat template keep the
chat template.
"""

from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest

from serving.errors import AdapterLoadFailed, InvalidRequest
from serving.openai.builders import Limits, choices, encode
from serving.openai.chat_format import TEMPLATES, trained_prompt, trained_style
from serving.openai.schemas import ChatCompletionRequest, ChatMessage
from serving.pool.run import PROMPT_STYLES
from serving.settings import ServeSettings
from serving.stack import ServingStack, StackConfig, build_stack
from tests.serving.helpers import ready_client, write_adapter
from training.data import IGNORE, Record, generate_suite, tokenize_record
from training.data.prompts import ALPACA_SHORT, ALPACA_SHORT_INPUT, PromptConfig, PromptStyle, format_prompt

RECORDS = [*generate_suite(n_train=2, n_test=1).tests.values()]
WITH_INPUT = Record(instruction="Summarise the context in one line.", input="Paris is the capital of France.\n\n"
                    "It lies on the Seine.", output="Paris, on the Seine, is France's capital.")


def request(messages: list[dict[str, Any]], **body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **body})


def messages_of(record: Record) -> list[dict[str, Any]]:
    """The chat equivalent of a record: its input as the system message, its instruction as the user's."""
    system = [{"role": "system", "content": record.input}] if record.input.strip() else []
    return [*system, {"role": "user", "content": record.instruction}]


def test_the_served_templates_are_the_ones_training_renders() -> None:
    assert TEMPLATES["alpaca_short"] == (ALPACA_SHORT, ALPACA_SHORT_INPUT)
    assert PROMPT_STYLES == typing.get_args(PromptStyle) == (*TEMPLATES, "chat")


@pytest.mark.parametrize("record", [*(r[0] for r in RECORDS), WITH_INPUT], ids=lambda r: r.instruction[:24])
def test_a_chat_request_is_the_trained_prompt_of_its_record(record: Record, tokenizer: Any) -> None:
    [choice] = choices(request(messages_of(record), temperature=0), tokenizer, Limits(), "alpaca_short")
    trained = tokenize_record(record, tokenizer)  # what training computed the loss after
    prompt_ids = [t for t, label in zip(trained.input_ids, trained.labels, strict=True) if label == IGNORE]
    assert choice.prompt == format_prompt(record) and choice.prompt_format == "alpaca_short"
    assert list(encode(tokenizer, choice.prompt)) == prompt_ids
    assert choice.shared_prefix == "### Instruction:\n"  # the server's text: other tenants' KV may serve it


def test_system_and_earlier_turns_become_the_context() -> None:
    def render(*turns: tuple[str, str], continue_final: bool = False) -> str:
        return trained_prompt([ChatMessage(role=r, content=c) for r, c in turns],  # type: ignore[arg-type]
                              "alpaca_short", continue_final)

    assert render(("user", "Hi")) == ALPACA_SHORT.format(instruction="Hi")
    assert render(("system", "Be brief."), ("developer", "Answer in French."), ("user", "Capital of Peru?")) == (
        ALPACA_SHORT_INPUT.format(instruction="Capital of Peru?", input="Be brief.\n\nAnswer in French."))
    conversation = [("system", "Be brief."), ("user", "Sort: b, a"), ("assistant", "a, b"), ("user", "Now: d, c")]
    assert render(*conversation) == ALPACA_SHORT_INPUT.format(
        instruction="Now: d, c", input="Be brief.\n\nUser: Sort: b, a\nAssistant: a, b")
    assert render(*conversation[1:]) == ALPACA_SHORT_INPUT.format(
        instruction="Now: d, c", input="User: Sort: b, a\nAssistant: a, b")
    # turns after the last user message (a tool result, an assistant turn) stay in the transcript, in order
    assert render(("user", "Weather?"), ("tool", "sunny"), ("assistant", "")) == ALPACA_SHORT_INPUT.format(
        instruction="Weather?", input="Tool: sunny\nAssistant: ")
    # continuing a final assistant message: its text follows the response header
    assert render(("user", "Count to 3"), ("assistant", "1, 2,"), continue_final=True) == (
        ALPACA_SHORT.format(instruction="Count to 3") + "1, 2,")
    parts = request([{"role": "user", "content": [{"type": "text", "text": "Sort: "}, {"type": "text", "text": "b"}]}])
    assert trained_prompt(parts.messages, "alpaca_short") == ALPACA_SHORT.format(instruction="Sort: b")
    with pytest.raises(InvalidRequest, match="user message") as no_user:
        render(("system", "Be brief."))
    assert no_user.value.param == "messages"
    with pytest.raises(InvalidRequest, match="final assistant") as nothing:
        render(("user", "Hi"), continue_final=True)
    assert nothing.value.param == "continue_final_message"


def test_the_request_fields_reach_the_trained_template(tokenizer: Any) -> None:
    turns = [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2,"}]
    body = request(turns, add_generation_prompt=False, continue_final_message=True)
    [choice] = choices(body, tokenizer, Limits(), "alpaca_short")
    assert choice.prompt == ALPACA_SHORT.format(instruction="Count to 3") + "1, 2,"
    [plain] = choices(request(turns), tokenizer, Limits(), "alpaca_short")  # a new answer after the transcript
    assert plain.prompt == ALPACA_SHORT_INPUT.format(instruction="Count to 3", input="Assistant: 1, 2,")


@pytest.fixture(scope="module")
def served(feddpa_run: Path, tmp_path_factory: pytest.TempPathFactory) -> ServingStack:
    """The trained tiny FedDPA run (alpaca_short) with an adapter from outside it, ``outside``."""
    root = tmp_path_factory.mktemp("chat-format")
    from models import tiny_llama

    write_adapter(tiny_llama(), root / "outside", seed=5)
    shutil.copytree(feddpa_run, root / "run")
    return build_stack(StackConfig(model="tiny", run_dir=root / "run", adapters=(f"outside={root / 'outside'}",),
                                   adapter_root=root))


def test_the_runs_targets_answer_chat_in_its_template_and_others_in_the_chat_template(served: ServingStack) -> None:
    for model in ("global", "sorting:local", "sorting", "capitals"):
        assert trained_style(served, model) == "alpaca_short", model
    assert trained_style(served, "global", [("global", 0.5), ("capitals:local", 0.5)]) == "alpaca_short"
    for model in ("tiny", "outside", "nope"):  # the base model, an adapter from elsewhere, an unknown name
        assert trained_style(served, model) is None, model
    assert trained_style(served, "global", [("global", 0.5), ("outside", 0.5)]) is None
    assert trained_style(served, "global", [("global", 0.5), ("global", 0.5)]) is None  # refused later, by submit
    assert trained_style(None, "global") is None


def test_an_amole_runs_clients_answer_in_its_template(tmp_path: Path) -> None:
    from tests.serving.test_amole_serving import write_amole

    write_amole(tmp_path / "run" / "adapters" / "amole", seed=0)
    (tmp_path / "run" / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    stack = build_stack(StackConfig(model="tiny", run_dir=tmp_path / "run"))
    assert stack.plan("c0").mode == "amole" and trained_style(stack, "c0") == "alpaca_short"


def test_a_run_with_an_unknown_prompt_style_is_refused_at_load(feddpa_run: Path, tmp_path: Path) -> None:
    run = shutil.copytree(feddpa_run, tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "train": {**meta["train"], "prompt_style": "vicuna"}}))
    with pytest.raises(AdapterLoadFailed, match="train.prompt_style 'vicuna'"):
        build_stack(StackConfig(model="tiny", run_dir=run))


def post(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_chat_equals_completions_in_the_trained_template_feddpa_routing_included(feddpa_run: Path) -> None:
    record = RECORDS[0][0]
    settings = ServeSettings(model="tiny", dtype="float32", run_dir=feddpa_run, routing_details="all",
                             prefix_cache_slots=0)
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ready_client(settings) as client:
        for model in ("sorting", "global", "capitals:local"):
            chat = post(client, "/v1/chat/completions", {"model": model, "messages": messages_of(record), **greedy})
            done = post(client, "/v1/completions", {"model": model, "prompt": format_prompt(record), **greedy})
            assert chat["choices"][0]["message"]["content"] == done["choices"][0]["text"], model
            assert chat["usage"] == done["usage"]
            assert chat["fedmosaic"]["prompt_format"] == "alpaca_short" and "prompt_format" not in done["fedmosaic"]
            # the FedDPA router saw the trained prompt: the same weights and similarities as the completion's
            assert chat["fedmosaic"]["weights"] == pytest.approx(done["fedmosaic"]["weights"], abs=1e-5)
            assert chat["fedmosaic"]["info"].keys() == done["fedmosaic"]["info"].keys()
        stream = client.post("/v1/chat/completions", json={"model": "sorting", "messages": messages_of(record),
                                                           "stream": True, **greedy}).text
        last = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")][-1]
        assert last["fedmosaic"]["prompt_format"] == "alpaca_short"
        base = post(client, "/v1/chat/completions", {"model": "tiny", "messages": messages_of(record), **greedy})
        tokenizer = client.app.state.server.engine.tokenizer  # type: ignore[attr-defined]
        templated = tokenizer.apply_chat_template(messages_of(record), tokenize=False, add_generation_prompt=True)
        assert base["fedmosaic"]["prompt_format"] == "chat_template"
        assert base["usage"]["prompt_tokens"] == len(encode(tokenizer, templated))
        refused = client.post("/v1/chat/completions", json={"model": "sorting", "max_tokens": 2,
                                                            "messages": [{"role": "system", "content": "Hi"}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_a_run_trained_with_prompt_style_chat_keeps_the_chat_template(tmp_path: Path, capsys: Any) -> None:
    from fedmosaic.cli import main

    argv = ["train", "--method", "feddpa-t", "--model", "tiny", "--data", "generated", "--n-train", "4", "--n-test",
            "1", "--families", "sorting,capitals", "--preset", "tiny", "--rounds", "2", "--prompt-style", "chat"]
    assert main([*argv, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["prompt_style"] == "chat"
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["train"]["prompt_style"] == "chat"
    record = RECORDS[0][0]
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with ready_client(ServeSettings(model="tiny", dtype="float32", run_dir=tmp_path / "run",
                                    prefix_cache_slots=0)) as client:
        stack = client.app.state.server.stack  # type: ignore[attr-defined]
        assert trained_style(stack, "sorting") is None
        chat = post(client, "/v1/chat/completions", {"model": "sorting", "messages": messages_of(record), **greedy})
        trained = format_prompt(record, stack.loaded.tokenizer, PromptConfig("chat"))  # training's chat prompt
        done = post(client, "/v1/completions", {"model": "sorting", "prompt": trained, **greedy})
    assert chat["fedmosaic"]["prompt_format"] == "chat_template"
    assert chat["choices"][0]["message"]["content"] == done["choices"][0]["text"] and chat["usage"] == done["usage"]
