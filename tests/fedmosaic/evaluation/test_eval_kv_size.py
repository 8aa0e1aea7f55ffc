"""Evaluation sizes the engine's KV cache from the job, not a worst case (issue 46).

On CUDA the cache is allocated at full length at once; ``fedmosaic eval`` used ``max_model_len=2^20``
("no cap"), 292 GiB for a SmolLM2 shape and 6.5 GiB even for the tiny test model. The cache now holds
the longest prompt plus ``max_new_tokens`` (rounded up, capped by the model's context), so the
full-length size checked here is what a CUDA device would be asked for.
"""

from __future__ import annotations

import pytest

from fedmosaic.evaluation.backend import EvalItem
from fedmosaic.evaluation.stack_backend import StackBackend, open_backend
from serving.beam import GenerationConfig, generate_target
from serving.engine import EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.stack import StackConfig, build_stack
from tests.fedmosaic.evaluation.test_evaluate import build_run

SHORT = "### Instruction:\nSort: pear, apple\n\n### Response:\n"
LONG = "### Instruction:\nSort: " + "pear apple kiwi " * 65 + "\n\n### Response:\n"  # about 700 tokens


def _items(prompts: list[str]) -> list[EvalItem]:
    return [EvalItem("final", "global", "sorting", i, "global", p, "", "t") for i, p in enumerate(prompts)]


def _full_length_bytes(backend: StackBackend) -> int:
    engine = backend.stack.engine
    return engine.kv.bytes_for(engine.config.max_model_len)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> StackBackend:
    run = build_run(tmp_path_factory.mktemp("kv"))
    return open_backend(run, run.read_config(), dtype="float32", max_new_tokens=5, batch_size=2)


def test_the_cache_is_sized_from_the_job_and_long_prompts_still_answer(backend: StackBackend) -> None:
    tokens = len(backend.tokenizer(LONG, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    assert 512 < tokens + 5 < 1024  # longer than the engine starts with, within the tiny model's context
    list(backend.generate(_items([SHORT])))
    assert _full_length_bytes(backend) <= 8 * 2**20  # 2^20 positions: 6.5 GiB for this tiny model
    got = {it.i: pred.text for it, pred in backend.generate(_items([SHORT, LONG]))}
    assert backend.stack.engine.config.max_model_len == 768  # 700-odd + 5, rounded up to 256s
    want = generate_target(backend.stack, "global", [SHORT, LONG], GenerationConfig(max_new_tokens=5))
    assert [got[0], got[1]] == [w.text.strip() for w in want]  # the engine's greedy answer = HF's


def test_a_prompt_beyond_the_models_context_fails_with_the_limit_named(backend: StackBackend) -> None:
    too_long = "Sort: " + "pear apple kiwi " * 110  # about 1,100 tokens; the tiny model's context is 1024
    with pytest.raises(RuntimeError, match="allows 1024 tokens"):
        list(backend.generate(_items([too_long])))
    assert backend.stack.engine.config.max_model_len == 1024


def test_fit_length_refuses_to_swap_an_engine_holding_requests() -> None:
    stack = build_stack(StackConfig(model="tiny", engine=EngineConfig(max_model_len=64)))
    handle = stack.engine.submit(GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=1)))
    with pytest.raises(RuntimeError, match="cannot be resized"):
        stack.fit_length(128)
    while not handle.done:
        stack.engine.step()
    engine = stack.engine
    stack.fit_length(128)
    assert stack.engine is not engine and stack.engine.config.max_model_len == 128
    assert stack.engine.model_lock is engine.model_lock  # the pool changes adapters under the same lock
