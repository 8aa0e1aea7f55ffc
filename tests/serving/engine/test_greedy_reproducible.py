"""Greedy reproducibility: one greedy request gives the same tokens (and log-probabilities, bit for bit)
cold, after a fully or partly cached prefix, in chunks, inside a mixed batch and beside running decodes.

Before the CPU attention reduced in fixed key blocks (``serving.engine.kernels.reference.invariant_attention``)
and a lone float32 row's products were computed as two (``serving.engine.runner.layout.linear``), the
roundings of a token followed the batch it went through: the longest row, the chunk's query count, a
one-token forward's matrix-vector products; the log-probabilities below then differed in the last bits,
and greedy answers on a near tie differed in tokens. The tiny model's matrices are too small for oneMKL and
oneDNN to choose kernels by row count; SmolLM2's are not, and the slow test runs it under oneMKL's strict mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import LoadedModel, tiny_llama
from serving.engine import Engine, EngineConfig, kernels
from serving.engine.request import GenerationRequest, GenerationResult
from serving.engine.sampling import SamplingParams
from tests.serving.helpers import adapted_with

SYSTEM = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request. ")
PROMPT = SYSTEM + "Convert 5 km to meters, then sort these words alphabetically: apple banana cherry."
NEIGHBOUR = SYSTEM + "What is the sentiment of this review? positive negative neutral"
OTHERS = ("Hi.", "Reformat the date 2024-03-15 as March 15, 2024, then add punctuation to it.",
          SYSTEM + "twelve plus seven", "The capital of France is")
TARGETS = {"base": ((), ()), "adapter": (("l1",), (1.0,)), "mixture": (("g", "l1"), (0.6, 0.4))}


def request(prompt: str, target: str, max_tokens: int = 8) -> GenerationRequest:
    names, weights = TARGETS[target]
    return GenerationRequest(prompt=prompt, adapter_names=names, adapter_weights=weights,
                             sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                     logprobs=0))


def answer(result: GenerationResult) -> tuple[tuple[int, ...], list[float]]:
    """The token ids and each one's log-probability (exact floats: any rounding difference shows)."""
    assert result.error is None and result.logprobs is not None
    return result.token_ids, [lp.logprob for lp in result.logprobs]


def answers(loaded: LoadedModel, target: str) -> dict[str, tuple[tuple[int, ...], list[float]]]:
    """The same greedy request cold, warm, partly cached, in a mixed batch, beside running decodes and in chunks."""
    engine = Engine(loaded, adapted_with(loaded), EngineConfig(max_batch_size=6, prefix_cache_slots=2,
                                                               route_state_cache=0))
    out = {"cold": answer(engine.generate([request(PROMPT, target)])[0])}
    assert engine.prefixes.hits == 0

    out["warm"] = answer(engine.generate([request(PROMPT, target)])[0])  # the whole prompt but its last token
    assert engine.prefixes.hits == 1

    engine.prefixes.clear()
    engine.generate([request(NEIGHBOUR, target, max_tokens=1)])
    out["partly cached"] = answer(engine.generate([request(PROMPT, target)])[0])  # the system prompt reused
    assert engine.prefixes.hits == 2

    engine.prefixes.clear()
    others = [request(text, t, max_tokens=12) for text, t in zip(OTHERS, ("adapter", "base", target, "mixture"),
                                                                    strict=True)]
    out["in a mixed batch"] = answer(engine.generate([*others[:2], request(PROMPT, target), *others[2:]])[2])

    engine.prefixes.clear()  # arriving while other rows decode: its prefill rides in their forward
    handles = [engine.submit(r) for r in others]
    for _ in range(3):
        engine.step()
    handle = engine.submit(request(PROMPT, target))
    while engine.has_work():
        engine.step()
    out["beside running decodes"] = answer(handle.result())
    assert all(h.result().error is None for h in handles)

    chunked = Engine(loaded, engine.adapted, EngineConfig(max_batch_size=2, max_prefill_tokens=7))
    out["in 7-token chunks"] = answer(chunked.generate([request(PROMPT, target)])[0])
    return out


def assert_all_alike(out: dict[str, tuple[tuple[int, ...], list[float]]]) -> None:
    cold = out["cold"]
    for label, got in out.items():
        assert got[0] == cold[0], f"{label}: tokens differ"
        assert got[1] == cold[1], f"{label}: log-probabilities differ"


@pytest.fixture(params=["float32", "autocast-bf16"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_llama(dtype=request.param)


@pytest.mark.parametrize("target", list(TARGETS))
def test_greedy_answers_are_the_same_cold_warm_chunked_and_batched(loaded: LoadedModel, target: str) -> None:
    assert_all_alike(answers(loaded, target))


@pytest.mark.slow
def test_smollm2_float32_greedy_is_reproducible_under_strict_mkl() -> None:
    """SmolLM2's matrices are large enough for oneMKL to pick kernels by row count; with its strict
    reproducibility mode (MKL_CBWR=AUTO,STRICT, docs/serving.md) a request is the same bits everywhere."""
    script = ("import json; from models import load_base_model; "
              "from tests.serving.engine.test_greedy_reproducible import answers; "
              "print(json.dumps(answers(load_base_model('smollm2', dtype='float32', device='cpu'), 'adapter')))")
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT", "FEDMOSAIC_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=Path(__file__).parents[3], capture_output=True,
                          text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert_all_alike({label: (tuple(tokens), logprobs) for label, (tokens, logprobs) in out.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_attends_alike_alone_in_a_chunk_and_beside_a_longer_row(dtype: torch.dtype) -> None:
    """The CPU attention of one query is the same bits whatever the call holds (SDPA's was not)."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(4, 3, 700, 64, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, 300, 9, 64, generator=gen).to(dtype)  # a 300-token prompt in slot 0, GQA 9 over 3
    whole = kernels.prefill_attention(q, k_cache, v_cache, torch.tensor([0]), torch.tensor([0]), torch.tensor([300]),
                                      0.125)
    last = kernels.prefill_attention(q[:, 299:], k_cache, v_cache, torch.tensor([0]), torch.tensor([299]),
                                     torch.tensor([300]), 0.125)  # after a cached prefix of 299
    beside = torch.zeros(2, 300, 9, 64, dtype=dtype)
    beside[0] = q[0]
    pair = kernels.prefill_attention(beside, k_cache, v_cache, torch.tensor([0, 2]), torch.tensor([0, 0]),
                                     torch.tensor([300, 650]), 0.125)[:1]  # a longer row in the batch
    decode = kernels.decode_attention(q[0, 299:].expand(3, 9, 64), k_cache, v_cache, torch.tensor([0, 1, 3]),
                                      torch.tensor([300, 600, 40]), 0.125)[:1]  # a decode step of three rows
    assert torch.equal(last[0, 0], whole[0, 299])
    assert torch.equal(pair, whole)
    assert torch.equal(decode[0], whole[0, 299])
