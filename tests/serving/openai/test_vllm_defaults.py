"""The pieces of vLLM's conventions without a server: generation-config defaults as vLLM reads them, how a
request's fields override them, template variables reaching the chat template, the unknown-field policy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import GenerationConfig

from models import tiny_tokenizer
from serving.errors import InvalidRequest
from serving.openai import builders
from serving.openai.compat import FieldPolicy, SamplingDefaults, generation_defaults
from serving.openai.schemas import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "Hi"}]


def test_auto_reads_what_differs_from_transformers_defaults() -> None:
    config = GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, max_new_tokens=64,
                              do_sample=True)
    assert generation_defaults("auto", config) == SamplingDefaults(0.6, 0.9, 20, None, 1.05, 64)
    assert generation_defaults("auto", GenerationConfig()) == SamplingDefaults()  # all defaults: none
    assert generation_defaults("vllm", config) == SamplingDefaults()
    assert generation_defaults("auto", None) == SamplingDefaults()


def test_a_folder_is_read_and_a_bad_one_named(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "min_p": 0.05, "do_sample": 1}))
    assert generation_defaults(str(tmp_path)) == SamplingDefaults(temperature=0.2, min_p=0.05)
    with pytest.raises(ValueError, match="cannot read"):
        generation_defaults(str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": "many"}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generation_defaults(str(tmp_path))


def test_request_fields_override_the_defaults_and_null_means_default() -> None:
    limits = builders.Limits(max_tokens_limit=100, default_max_tokens=10,
                             defaults=SamplingDefaults(temperature=0.3, top_p=0.8, top_k=7, min_p=0.1,
                                                       repetition_penalty=1.2, max_tokens=40))
    unset = builders.sampling_params(ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT}), limits)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty, unset.max_tokens) \
        == (0.3, 0.8, 7, 0.1, 1.2, 40)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "temperature": 1.0, "top_p": None,
                                                 "top_k": -1, "min_p": 0.0, "max_tokens": 5})
    given = builders.sampling_params(body, limits)
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.max_tokens) == (1.0, 0.8, 0, 0.0, 5)
    # a completion's wire default max_tokens (16) is a value, as vLLM reads it: the model's default is for null
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert builders.sampling_params(completion, limits).max_tokens == 16
    none = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None})
    assert builders.sampling_params(none, limits).max_tokens == 40
    plain = builders.sampling_params(completion, builders.Limits())
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (1, 1, 0, 0, 1)


def test_chat_template_kwargs_reach_the_template() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% if greeting %}{{ greeting }}\n{% endif %}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}{% if add_generation_prompt %}>>{% endif %}")
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT,
                                                 "chat_template_kwargs": {"greeting": "Hello there"}})
    assert builders.chat_prompt(tokenizer, body) == "Hello there\nHi>>"
    assert builders.template_prefix(tokenizer, body, "Hello there\nHi>>") == "Hello there\n"
    quiet = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "add_generation_prompt": False})
    assert builders.chat_prompt(tokenizer, quiet) == "Hi"


def test_field_policy(caplog: pytest.LogCaptureFixture) -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{**CHAT[0], "k": 1}], "a": 1, "b": 2})
    policy = FieldPolicy()
    with caplog.at_level(logging.WARNING, logger="serving.openai.compat"):
        assert policy.check(body) == ["a", "b", "messages.k"]
        assert policy.check(body) == ["a", "b", "messages.k"]
    assert len(caplog.records) == 3
    with pytest.raises(InvalidRequest) as refused:
        FieldPolicy(strict=True).check(body)
    assert refused.value.param == "a"
    assert FieldPolicy(strict=True).check(ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT})) == []
