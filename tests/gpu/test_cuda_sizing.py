"""On a CUDA GPU (``make test-gpu``, issue 46): caches sized to the job and the card, and the host-work counts
on a real device (AMoLE's serving benchmark there: tests/bench/serving/test_amole.py).

A random SmolLM2-shaped model in bf16: ``fedmosaic eval``'s backend grows its engine to a long prompt
(2^20 positions, the old "no cap", were 292 GiB), a default engine takes as many slots as 0.8 x the free
memory holds, and a decode step's synchronisations are counted without depending on its rows. Skipped
without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from fedmosaic.evaluation.backend import EvalItem
from fedmosaic.evaluation.stack_backend import StackBackend
from models import LoadedModel, tiny_llama
from serving.engine import Engine, EngineConfig, StepReport
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.stack import StackConfig, build_stack

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tiny_llama().tokenizer, name="smollm2-shape", dtype="bfloat16")


def test_eval_grows_its_cache_to_a_long_prompt_on_a_smollm2_shape(smollm2: LoadedModel) -> None:
    stack = build_stack(StackConfig(model="smollm2-shape", engine=EngineConfig(max_model_len=512)), loaded=smollm2)
    backend = StackBackend(stack, max_new_tokens=8)
    prompt = "Sort: " + "pear apple kiwi " * 60
    items = [EvalItem("final", "base", "t", i, "smollm2-shape", p, "", "t") for i, p in enumerate([prompt, "hi"])]
    answers = list(backend.generate(items))
    assert len(answers) == 2 and 512 < stack.engine.config.max_model_len <= 8192
    engine = stack.engine
    assert engine.kv.bytes_for(engine.config.max_model_len) < 2**30  # 2^20 positions: 292 GiB


def test_a_default_engine_fills_its_share_of_the_free_memory(smollm2: LoadedModel) -> None:
    free_before, _ = torch.cuda.mem_get_info()
    engine = Engine(smollm2, None, EngineConfig(auto_slots=True, auto_context=True, max_waiting=512))
    plan = engine.slot_plan
    assert plan is not None and plan.kv_bytes <= 0.8 * free_before and plan.slots >= 8
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = engine.generate([GenerationRequest(prompt_ids=(5, 6, 7, i), sampling=params) for i in range(32)])
    assert all(len(r.token_ids) == 4 for r in results)
    del engine
    torch.cuda.empty_cache()


def test_decode_steps_sync_as_often_whatever_their_rows() -> None:
    def run(rows: int) -> set[int]:
        engine = Engine(tiny_llama(device="cuda"), None, EngineConfig(count_syncs=True))
        reports: list[StepReport] = []
        engine.step_observers.append(reports.append)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate([GenerationRequest(prompt=f"hello {i}", sampling=params) for i in range(rows)])
        return {r.syncs for r in reports if r.kind == "decode"}

    one, four = run(1), run(4)
    assert one and min(one) >= 1 and one == four
