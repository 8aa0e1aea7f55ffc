"""Engine tests on the tiny model: HF-greedy equivalence, mixed continuous batches, sampling, stops."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig, StepReport
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.errors import AdapterNotFound, InvalidRequest
from tests.serving.helpers import adapted_with

PROMPTS = ["The capital of France is", "Sort these words", "twelve plus seven equals", "Convert 5 km"]
MIXES = [(("g", "l1"), (0.7, 0.3)), (("g", "l2"), (0.2, 0.8)), (("l1",), (1.0,)), ((), ())]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def hf_greedy(tiny: LoadedModel, adapted, prompt: str, names, weights, n: int) -> list[int]:
    ids = tiny.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        if names:
            with adapted.context.use(tuple(names), torch.tensor([weights])):
                out = tiny.model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=2, eos_token_id=2)
        else:
            out = tiny.model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=2, eos_token_id=2)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    return new[: new.index(2) + 1] if 2 in new else new


@pytest.fixture()
def engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=8))


def test_adapters_matter(engine: Engine) -> None:
    plain, mixed = engine.generate([
        GenerationRequest(prompt=PROMPTS[0], sampling=greedy()),
        GenerationRequest(prompt=PROMPTS[0], sampling=greedy(), adapter_names=("l1",), adapter_weights=(1.0,)),
    ])
    assert plain.token_ids != mixed.token_ids


def test_greedy_equals_hf_generate(engine: Engine, tiny: LoadedModel) -> None:
    for prompt, (names, weights) in zip(PROMPTS, MIXES, strict=True):
        result = engine.generate([GenerationRequest(prompt=prompt, sampling=greedy(), adapter_names=names,
                                                    adapter_weights=weights)])[0]
        assert list(result.token_ids) == hf_greedy(tiny, engine.adapted, prompt, names, weights, 12)
        assert result.prompt_tokens == len(tiny.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert result.completion_tokens == len(result.token_ids)


def test_continuous_batch_of_mixed_clients_equals_solo_runs(engine: Engine) -> None:
    requests = [GenerationRequest(prompt=p, sampling=greedy(6 + 3 * i), adapter_names=n, adapter_weights=w)
                for i, (p, (n, w)) in enumerate(zip(PROMPTS, MIXES, strict=True))]
    solo = [engine.generate([r])[0] for r in requests]
    # Submit at different steps: two now, one after two steps, one after four.
    handles = [engine.submit(requests[0]), engine.submit(requests[1])]
    engine.step()
    engine.step()
    handles.append(engine.submit(requests[2]))
    engine.step()
    assert engine.stats().running == 3
    engine.step()
    handles.append(engine.submit(requests[3]))
    while engine.step():
        pass
    for handle, alone in zip(handles, solo, strict=True):
        assert handle.result().token_ids == alone.token_ids
        assert handle.result().text == alone.text
    assert engine.stats().running == 0 and engine.stats().kv_length == 0


def test_max_tokens_gives_length(engine: Engine) -> None:
    result = engine.generate([GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True))])[0]
    assert result.finish_reason == "length" and result.completion_tokens == 5


def test_results_report_the_time_to_first_token(engine: Engine) -> None:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    handle = engine.submit(GenerationRequest(prompt=PROMPTS[0], sampling=params))
    never = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=params))
    never.cancel()  # cancelled before its first step: no token, no time to first token
    time.sleep(0.02)  # queued time counts: the clock starts at submission
    while engine.step():
        pass
    assert never.result().first_token_s is None
    first = handle.result().first_token_s
    assert first is not None and first >= 0.02


def test_step_observers_see_each_forward_and_cannot_stop_the_engine(engine: Engine) -> None:
    seen: list[StepReport] = []

    def broken(_: StepReport) -> None:
        raise RuntimeError("an observer bug")

    engine.step_observers[:] = [broken, seen.append]
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        handles = [engine.submit(GenerationRequest(prompt=p, sampling=params)) for p in PROMPTS[:2]]
        while engine.step():
            pass
    finally:
        engine.step_observers.clear()
    assert all(h.result().finish_reason == "length" for h in handles)
    prompt = sum(h.result().prompt_tokens for h in handles)
    assert sum(r.prefill_tokens for r in seen) == prompt
    # the prefill gives the first tokens; a row whose prefill ended takes its next token in the next step
    assert [r.kind for r in seen] == ["prefill", "decode", "decode"]
    assert [r.decode_rows for r in seen] == [0, 2, 2] and all(r.seconds > 0 for r in seen)


def test_stop_string_is_trimmed(engine: Engine) -> None:
    full = engine.generate([GenerationRequest(prompt=PROMPTS[2], sampling=SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True))])[0]
    assert len(full.text) > 4
    stop = full.text[3:5]
    cut = engine.generate([GenerationRequest(prompt=PROMPTS[2], sampling=SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, stop=(stop,)))])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text


def test_seed_reproduces_sampling(engine: Engine) -> None:
    def run(seed: int, shared: bool = False) -> tuple[int, ...]:
        params = SamplingParams(max_tokens=10, temperature=1.3, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        req = GenerationRequest(prompt=PROMPTS[1], sampling=params, adapter_names=("l2",), adapter_weights=(1.0,))
        other = GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=4, temperature=1.0))
        return engine.generate([other, req] if shared else [req])[-1].token_ids

    first = run(7)
    assert run(7, shared=True) == first  # a sampled neighbour in the batch changes nothing
    assert run(8) != first


def test_cancel_leaves_the_batch(engine: Engine) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    keep = engine.submit(GenerationRequest(prompt=PROMPTS[0], sampling=params))
    drop = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=params))
    waiting = engine.submit(GenerationRequest(prompt=PROMPTS[2], sampling=params))
    engine.step()
    engine.step()
    drop.cancel()
    waiting.cancel()
    engine.step()
    assert drop.result().finish_reason == "cancelled" and 0 < drop.result().completion_tokens < 30
    assert waiting.done  # it was admitted at the first step, cancelled as a running row
    assert engine.stats().running == 1
    while engine.step():
        pass
    assert keep.result().finish_reason == "length" and keep.result().completion_tokens == 30


def test_stream_deltas_concatenate_to_text(engine: Engine) -> None:
    engine.start()
    try:
        handle = engine.submit(GenerationRequest(prompt=PROMPTS[3], sampling=SamplingParams(
            max_tokens=25, temperature=0.9, seed=1, ignore_eos=True, stop=("zz",))))
        deltas = list(handle.stream(timeout=30))
        assert "".join(deltas) == handle.result().text
        assert len(deltas) > 1
    finally:
        engine.stop()


def test_weight_fn_sees_prefill_state_and_sets_decode_weights(engine: Engine) -> None:
    seen: list[torch.Tensor] = []
    given: list[list[int]] = []

    def route(state: torch.Tensor, ids: list[int]) -> tuple[list[float], dict[str, float]]:
        seen.append(state)
        given.append(list(ids))
        return [0.4, 0.6], {"alpha": 0.6}

    req = GenerationRequest(prompt=PROMPTS[0], sampling=greedy(), adapter_names=("g", "l1"),
                            adapter_weights=(1.0, 0.0), prefill_weights=(1.0, 0.0), weight_fn=route,
                            exact_prefill=True)
    routed = engine.generate([req])[0]
    direct = engine.generate([GenerationRequest(prompt=PROMPTS[0], sampling=greedy(), adapter_names=("g", "l1"),
                                                adapter_weights=(0.4, 0.6))])[0]
    assert seen[0].shape == (64,)
    assert given == [engine.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]]  # type: ignore[operator]
    assert routed.adapter_weights == (0.4, 0.6) and routed.route_info == {"alpha": 0.6}
    assert routed.token_ids == direct.token_ids


def test_submit_errors(engine: Engine) -> None:
    with pytest.raises(AdapterNotFound):
        engine.submit(GenerationRequest(prompt="x", adapter_names=("nope",), adapter_weights=(1.0,)))
    with pytest.raises(InvalidRequest):
        engine.submit(GenerationRequest(prompt_ids=tuple(range(3000))))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize(("budget", "running", "steps_to_first"),
                         [(512, False, 1), (512, True, 1), (None, True, 2), (None, False, 1)])
def test_exact_routing_refills_in_the_same_step_when_the_budget_allows(tiny: LoadedModel, budget: int | None,
                                                                       running: bool, steps_to_first: int) -> None:
    """Routing pass and exact pass share a step while the prefill budget holds both (one step less to TTFT).

    With no running rows the budget bounds each forward: a budget of one pass still holds both."""
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_prefill_tokens=512, max_decode_skips=0))
    if running:
        other = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=SamplingParams(
            max_tokens=200, temperature=0.0, ignore_eos=True)))
        engine.step()
    handle = engine.submit(GenerationRequest(
        prompt=PROMPTS[0], sampling=greedy(), adapter_names=("g", "l1"), adapter_weights=(1.0, 0.0),
        prefill_weights=(1.0, 0.0), weight_fn=lambda state, ids: ([0.4, 0.6], {}), exact_prefill=True))
    seq = next(s for s in engine._active + list(engine._waiting) if s.handle is handle)
    if budget is None:  # exactly one pass's tokens
        engine.config = dataclasses.replace(engine.config, max_prefill_tokens=len(seq.ids))
    steps = 0
    while not seq.output:
        engine.step()
        steps += 1
    assert steps == steps_to_first
    if running:
        other.cancel()
    while engine.step():
        pass
    direct = engine.generate([GenerationRequest(prompt=PROMPTS[0], sampling=greedy(), adapter_names=("g", "l1"),
                                                adapter_weights=(0.4, 0.6))])[0]
    assert handle.result().token_ids == direct.token_ids


@pytest.mark.parametrize(("running", "expected"), [(True, [0, 1, 2]), (False, [0, 0, 1])])
def test_a_burst_of_routed_prompts_gets_first_tokens_in_arrival_order(tiny: LoadedModel, running: bool,
                                                                      expected: list[int]) -> None:
    """Beside running rows, a step whose budget holds one request's two passes runs both for the first
    prompt, not the routing passes of two: the first request gets its first token after one step, the
    rest after later ones. With no running rows the exact passes get a budget of their own: the step
    routes as many prompts as that budget holds and runs their exact passes in a second forward."""
    same = "one two three four five six"  # equal lengths: every prompt needs the same budget
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_prefill_tokens=512, prefix_cache_slots=0,
                                                           max_decode_skips=8))
    n = len(engine.tokenizer(same, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    if running:
        other = engine.submit(GenerationRequest(prompt=same, sampling=SamplingParams(
            max_tokens=200, temperature=0.0, ignore_eos=True)))
        engine.step()
    engine.config = dataclasses.replace(engine.config, max_prefill_tokens=2 * n + 1)
    handles = [engine.submit(GenerationRequest(
        prompt=same, sampling=greedy(2), adapter_names=("g", "l1"), adapter_weights=(1.0, 0.0),
        prefill_weights=(1.0, 0.0), weight_fn=lambda state, ids: ([0.4, 0.6], {}), exact_prefill=True))
        for _ in range(3)]
    seqs = [next(s for s in engine._active + list(engine._waiting) if s.handle is h) for h in handles]
    started: list[list[int]] = []
    while any(not s.output for s in seqs):
        engine.step()
        started.append([len(s.output) for s in seqs])
    first = [next(i for i, row in enumerate(started) if row[b]) for b in range(3)]
    assert first == expected  # all routing passes first would give no first token after the first step
    if running:
        other.cancel()
    while engine.step():
        pass
    assert all(h.result().finish_reason == "length" for h in handles)


def test_routing_to_the_prefill_weights_skips_the_exact_pass(tiny: LoadedModel) -> None:
    """a = 0 (the prefill's own weights): the routing pass is exact already, so the prompt is prefilled once."""
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_prefill_tokens=512))
    passes: list[int] = []
    prefill = engine.executor.prefill

    def counting(rows):  # type: ignore[no-untyped-def]
        passes.append(len(rows))
        return prefill(rows)

    engine.executor.prefill = counting  # type: ignore[method-assign]
    req = GenerationRequest(prompt=PROMPTS[0], sampling=greedy(), adapter_names=("g", "l1"), adapter_weights=(1.0, 0.0),
                            prefill_weights=(1.0, 0.0), weight_fn=lambda state, ids: ([1.0, 0.0], {}),
                            exact_prefill=True)
    routed = engine.generate([req])[0]
    assert passes == [1] and routed.adapter_weights == (1.0, 0.0)
    passes.clear()
    direct = engine.generate([GenerationRequest(prompt=PROMPTS[0], sampling=greedy(), adapter_names=("g", "l1"),
                                                adapter_weights=(1.0, 0.0))])[0]
    assert passes == [1] and routed.token_ids == direct.token_ids
    passes.clear()  # prompt log-probabilities are recorded by the exact pass only: it still runs
    logprobs = dataclasses.replace(req, sampling=dataclasses.replace(greedy(), prompt_logprobs=0))
    engine.generate([logprobs])
    assert sum(passes) == 2
