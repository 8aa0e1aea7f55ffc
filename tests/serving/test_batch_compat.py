"""vLLM's conventions in ``fedmosaic batch`` as on the server: unknown fields ignored with one warning per name,
``best_of`` keeping the most likely candidates, the model's sampling defaults for what a line leaves unset."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from serving.batch import BatchConfig, run_batch
from serving.engine import EngineConfig
from serving.openai.compat import SamplingDefaults
from serving.stack import StackConfig, build_stack

COMMON: dict[str, Any] = {"model": "tiny", "prompt": "The sky is", "max_tokens": 5, "temperature": 1.0, "seed": 11,
                          "ignore_eos": True}


def answer(tmp_path: Path, bodies: dict[str, dict[str, Any]], config: BatchConfig) -> dict[str, dict[str, Any]]:
    stack = build_stack(StackConfig(model="tiny", dtype="float32", engine=EngineConfig(max_batch_size=4)))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "url": "/v1/completions", "body": v}) + "\n"
                           for k, v in bodies.items()))
    run_batch(stack, stack.loaded.tokenizer, src, out, config, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {r["custom_id"]: r["response"]["body"] for r in rows if r["response"]["status_code"] == 200}


def test_batch_lines_follow_vllms_conventions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bodies: dict[str, dict[str, Any]] = {
        "all": {**COMMON, "n": 3, "logprobs": 0}, "best": {**COMMON, "best_of": 3, "top_a": 1},
        "again": {**COMMON, "top_a": 2},
        "unset": {"model": "tiny", "prompt": "The sky is", "max_tokens": None, "ignore_eos": True}}
    with caplog.at_level(logging.WARNING, logger="serving.openai.compat"):
        got = answer(tmp_path, bodies, BatchConfig(max_tokens_limit=32, defaults=SamplingDefaults(max_tokens=7)))
    assert set(got) == set(bodies)
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in got["all"]["choices"]]
    best = max(range(3), key=lambda i: scores[i])
    assert [c["text"] for c in got["best"]["choices"]] == [got["all"]["choices"][best]["text"]]
    assert got["unset"]["usage"]["completion_tokens"] == 7  # the model's max_new_tokens
    assert [r.getMessage() for r in caplog.records].count(
        "ignoring the unknown request field 'top_a' (warned once per field name; --strict-fields refuses such "
        "requests)") == 1
