"""Issue 15's sampling parameters in the engine, each against a reference on the tiny model (float32).

Log-probabilities equal ``log_softmax`` of a teacher-forced HF forward; echo's prompt log-probabilities
likewise (also when the prompt is prefilled in chunks); penalties, logit bias, ``min_tokens`` and
``stop_token_ids`` equal a naive greedy loop that applies them to a full forward's logits (and the
repetition penalty equals HF ``generate``'s own).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from tests.serving.helpers import adapted_with

PROMPT = "The capital of France is Paris and the capital of Italy is"
MIX = (("g", "l1"), (0.6, 0.4))


def ids_of(tiny: LoadedModel, text: str) -> list[int]:
    return list(tiny.tokenizer(text, add_special_tokens=False)["input_ids"])


def forward_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """(T, V) float32 logits of a teacher-forced HF forward with the request's adapter mixture."""
    with torch.inference_mode(), engine.adapted.context.use(MIX[0], torch.tensor([MIX[1]])):  # type: ignore[union-attr]
        return engine.model(input_ids=torch.tensor([ids])).logits[0].float()


def request(sampling: SamplingParams, prompt: str = PROMPT) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=sampling, adapter_names=MIX[0], adapter_weights=MIX[1])


@pytest.fixture()
def engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny, adapted_with(tiny))


def test_logprobs_are_the_models_log_softmax(engine: Engine, tiny: LoadedModel) -> None:
    result = engine.generate([request(SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))])[0]
    prompt = ids_of(tiny, PROMPT)
    assert result.logprobs is not None and len(result.logprobs) == 6
    for i, entry in enumerate(result.logprobs):
        logp = torch.log_softmax(forward_logits(engine, prompt + list(result.token_ids[:i]))[-1], -1)
        assert entry.token == result.token_ids[i]
        assert entry.logprob == pytest.approx(float(logp[entry.token]), abs=1e-4)
        top = torch.topk(logp, 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = engine.generate([request(SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])[0]
    assert plain.logprobs is None and plain.token_ids == result.token_ids


@pytest.mark.parametrize(("chunk", "runner"), [(512, "fused"), (3, "fused"), (512, "hf"), (3, "hf")])
def test_echo_prompt_logprobs_equal_a_teacher_forced_forward(tiny: LoadedModel, chunk: int, runner: str) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_prefill_tokens=chunk, runner=runner))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    result = engine.generate([request(params)])[0]
    prompt = ids_of(tiny, PROMPT)
    logp = torch.log_softmax(forward_logits(engine, prompt), -1)  # (T, V)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt)
    assert result.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry = result.prompt_logprobs[j]
        assert entry is not None and entry.token == prompt[j]
        assert entry.logprob == pytest.approx(float(logp[j - 1, prompt[j]]), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(logp[j - 1], 2).indices.tolist()


def naive_greedy(engine: Engine, tiny: LoadedModel, params: SamplingParams, n: int) -> list[int]:
    """Full forward per token, the processors applied by hand to the last logits, argmax."""
    prompt = ids_of(tiny, PROMPT)
    out: list[int] = []
    for _ in range(n):
        logits = forward_logits(engine, prompt + out)[-1].clone()
        if params.min_tokens and len(out) < params.min_tokens:
            for t in {*engine.eos_ids, *params.stop_token_ids}:
                logits[t] = float("-inf")
        for t, bias in params.logit_bias:
            logits[t] += bias
        if params.repetition_penalty != 1.0:
            for t in set(prompt) | set(out):
                value = logits[t]
                logits[t] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for t, c in Counter(out).items():
            logits[t] -= params.frequency_penalty * c + params.presence_penalty
        token = int(torch.argmax(logits))
        out.append(token)
        if token in params.stop_token_ids:
            break
    return out


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"presence_penalty": -1.0, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.8}, {"logit_bias": ((7, 9.0), (11, -100.0))}, {"repetition_penalty": 0.5},
])
def test_processors_equal_a_naive_loop(engine: Engine, tiny: LoadedModel, kwargs: dict) -> None:  # type: ignore[type-arg]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **kwargs)
    result = engine.generate([request(params)])[0]
    assert list(result.token_ids) == naive_greedy(engine, tiny, params, 10)


def test_repetition_penalty_equals_hf_generate(engine: Engine, tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    ours = engine.generate([request(params)])[0].token_ids
    enc = tiny.tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode(), engine.adapted.context.use(MIX[0], torch.tensor([MIX[1]])):  # type: ignore[union-attr]
        hf = tiny.model.generate(**enc, max_new_tokens=10, do_sample=False, repetition_penalty=1.3,
                                 pad_token_id=2, eos_token_id=None)
    assert list(ours) == hf[0, enc["input_ids"].shape[1]:].tolist()


def test_min_tokens_and_stop_token_ids(engine: Engine, tiny: LoadedModel) -> None:
    eos = min(engine.eos_ids)
    forced = SamplingParams(max_tokens=10, temperature=0, logit_bias=((eos, 100.0),), min_tokens=3)
    result = engine.generate([request(forced)])[0]
    assert len(result.token_ids) == 4 and result.token_ids[-1] == eos and eos not in result.token_ids[:3]
    assert list(result.token_ids) == naive_greedy(engine, tiny, forced, 4)
    free = engine.generate([request(SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))])[0]
    stop = free.token_ids[4]
    cut = engine.generate([request(SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                  stop_token_ids=(stop,)))])[0]
    first = free.token_ids.index(stop)
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: first + 1]


@pytest.mark.parametrize("kwargs", [{"logprobs": 21}, {"presence_penalty": 3.0}, {"repetition_penalty": 0.0},
                                    {"logit_bias": ((1, 101.0),)}, {"min_tokens": 99}, {"stop_token_ids": (-1,)}])
def test_out_of_range_parameters_are_refused(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=10, **kwargs)


def test_token_ids_beyond_the_vocabulary_are_refused(engine: Engine) -> None:
    from serving.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.submit(request(SamplingParams(logit_bias=((10**6, 1.0),))))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("pick", [[0, 1, 2, 3, 4], [1, 3, 5], [2], [0, 1, 3], [4, 2, 0]])
def test_sampled_rows_are_batched_in_one_copy(pick: list[int], transposed: bool) -> None:
    """A step's logits rows are sampled as one contiguous (N, V) batch equal to ``torch.stack`` of them,
    also when they are rows of a transposed (head-major) output, unevenly spaced, or of other tensors."""
    from serving.engine.executor import stacked

    out = torch.randn(11, 6).t() if transposed else torch.randn(6, 11)  # (6, 11)
    rows = [out[b] for b in pick]
    batch = stacked(rows)
    assert batch.is_contiguous() and torch.equal(batch, torch.stack(rows))
    other = [torch.randn(11), *rows[1:]]
    assert torch.equal(stacked(other), torch.stack(other))
