"""Issue 14, fault isolation: poison requests, failing rows, a dying engine thread, deadlines, shutdown.

One request must never stop the others: each test breaks one request (or the engine on purpose) and
checks that the others still get exactly what they get alone, that nothing hangs (every wait has a
timeout), and that errors carry the status the API reports (400 caused by the request, 500 with the
request id, 504 past the deadline).
"""

from __future__ import annotations

import time

import pytest
import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.kv import SlotKV
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.errors import EngineNotReady, InvalidRequest
from tests.serving.helpers import adapted_with

PROMPTS = ["The capital of France is", "Sort these words", "twelve plus seven equals", "Convert 5 km"]


def greedy(prompt: str, n: int = 8, **kw: object) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                             **kw)  # type: ignore[arg-type]


@pytest.fixture()
def engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4))


def test_a_tiny_temperature_is_greedy_and_the_next_request_works(engine: Engine) -> None:
    poison = GenerationRequest(prompt="Hi", sampling=SamplingParams(max_tokens=4, temperature=1e-45))
    tiny_t, plain = engine.generate([poison, greedy("Hi", 4)])
    assert tiny_t.finish_reason in ("length", "stop") and tiny_t.token_ids[:1] == plain.token_ids[:1]
    assert engine.generate([greedy(PROMPTS[0])])[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs", [{"seed": 1180591620717411303424}, {"seed": -(2**64)}, {"stop": ("x" * 257,)},
                                    {"stop": tuple("abcdefghijklmnopq")}, {"temperature": float("nan")}])
def test_out_of_range_sampling_parameters_are_refused(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_malformed_text_and_token_ids_are_invalid_requests(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="not valid text"):
        engine.submit(greedy("a lone surrogate \ud800 here"))
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.submit(GenerationRequest(prompt_ids=(1, 2, 10**9)))
    assert engine.generate([greedy(PROMPTS[1])])[0].finish_reason == "length"


def test_a_failing_router_fails_only_its_request(engine: Engine) -> None:
    def broken(state: torch.Tensor, ids: object) -> tuple[list[float], dict]:  # type: ignore[type-arg]
        raise RuntimeError("router crashed")

    def wrong(state: torch.Tensor, ids: object) -> tuple[list[float], dict]:  # type: ignore[type-arg]
        return [1.0], {}

    others = [greedy(p, adapter_names=("g", "l1"), adapter_weights=(0.5, 0.5)) for p in PROMPTS[:2]]
    alone = [engine.generate([r])[0].token_ids for r in others]
    bad = [greedy(PROMPTS[2], adapter_names=("g", "l1"), adapter_weights=(1.0, 0.0), weight_fn=fn)
           for fn in (broken, wrong)]
    results = engine.generate([others[0], bad[0], others[1], bad[1]])
    assert [results[0].token_ids, results[2].token_ids] == alone
    crashed, mismatched = results[1], results[3]
    assert crashed.finish_reason == "error" and crashed.error_status == 500
    assert crashed.request_id in (crashed.error or "") and "router crashed" not in (crashed.error or "")
    assert mismatched.error_status == 400 and "weight_fn returned 1 weights" in (mismatched.error or "")


def test_a_row_whose_forward_fails_is_isolated(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [greedy(p) for p in PROMPTS]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    poison_slot = 2  # the third admitted request's KV slot
    fast = engine.executor.fast
    assert fast is not None
    real = fast.decode

    def decode(rows):  # type: ignore[no-untyped-def]
        if any(r.slot == poison_slot and r.position > 7 for r in rows):
            raise RuntimeError("simulated kernel failure")
        return real(rows)

    monkeypatch.setattr(fast, "decode", decode)
    results = engine.generate(requests)
    assert results[2].finish_reason == "error" and results[2].error_status == 500
    assert [r.token_ids for i, r in enumerate(results) if i != 2] == [a for i, a in enumerate(alone) if i != 2]
    assert engine.kv.free_slots == 4


def test_the_engine_thread_dying_answers_everyone_and_reports(engine: Engine, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    reasons: list[str] = []
    engine.on_failure.append(reasons.append)
    engine.start()
    long = [engine.submit(GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=10_000, temperature=0,
                                                                               ignore_eos=True))) for p in PROMPTS]
    while engine.stats().running < 4:
        time.sleep(0.005)
    queued = engine.submit(greedy(PROMPTS[0]))  # waits: every slot is taken

    def bug(finished: object) -> None:
        raise KeyError("scheduler bug")

    monkeypatch.setattr(engine, "_admit", bug)
    for handle in long + [queued]:
        result = handle.result(timeout=10)  # answered at once, never a hang
        assert result.finish_reason == "error" and result.error_status == 500
        assert handle.request_id in (result.error or "")
    assert reasons and "scheduler bug" in reasons[0]
    assert "scheduler bug" in (engine.health() or "")
    with pytest.raises(EngineNotReady, match="failed"):
        engine.submit(greedy(PROMPTS[0]))
    monkeypatch.undo()
    engine.restart()
    try:
        assert engine.health() is None
        assert engine.submit(greedy(PROMPTS[1], 3)).result(timeout=30).completion_tokens == 3
    finally:
        engine.stop()


def test_a_request_past_its_deadline_is_answered_with_504(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(request_timeout_s=0.2))
    engine.start()
    try:
        slow = engine.submit(GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(
            max_tokens=100_000, temperature=0, ignore_eos=True)))
        result = slow.result(timeout=10)
        assert result.error_status == 504 and "deadline" in (result.error or "")
        assert 0 < result.completion_tokens < 100_000
        assert engine.submit(greedy(PROMPTS[1], 2)).result(timeout=10).finish_reason == "length"
    finally:
        engine.stop()


def test_shutdown_is_bounded_and_lets_short_requests_finish(engine: Engine) -> None:
    engine.start()
    short = engine.submit(greedy(PROMPTS[0], 3))
    endless = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=SamplingParams(
        max_tokens=100_000, temperature=0, ignore_eos=True)))
    t0 = time.monotonic()
    engine.stop(timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert short.result(timeout=1).finish_reason == "length"
    assert endless.result(timeout=1).finish_reason == "cancelled"
    with pytest.raises(EngineNotReady):
        engine.submit(greedy(PROMPTS[0]))


def test_a_request_whose_values_went_nan_does_not_poison_its_slots_next_owner(tiny: LoadedModel) -> None:
    """An adapter of huge finite weights (NaN ones are refused at load) fills its request's KV slot with
    inf and NaN; the next owner of that slot, a row shorter than the batch's longest (it reads stale
    positions at weight 0), still decodes what it decodes alone."""
    adapted = adapted_with(tiny, ("g", "l1", "broken"))
    for _, layer in adapted.adapter_layers("broken"):
        a = layer.adapters["broken"]
        layer.set_weights("broken", a.lora_A.detach().clone(), torch.full(a.lora_B.shape, 3e38))
    engine = Engine(tiny, adapted, EngineConfig(max_batch_size=4))
    long_prompt = PROMPTS[1] + ", then the numbers from one to twenty in words"
    short, long = greedy(PROMPTS[0], 4), greedy(long_prompt, 12)
    alone = [engine.generate([r])[0].token_ids for r in (short, long)]
    poison = engine.generate([greedy(long_prompt, 12, adapter_names=("broken",), adapter_weights=(1.0,))])[0]
    assert poison.finish_reason in ("error", "length")  # whatever NaN logits give, it ends
    # every sequence slot is finite again (spare slots may keep the prompt for the same adapter: never read)
    assert engine.kv.free_slots == 4
    assert all(torch.isfinite(c[: engine.kv.num_slots]).all() for c in engine.kv.k + engine.kv.v)
    together = engine.generate([short, long])  # short takes the poisoned slot 0 and reads past its length
    assert [r.token_ids for r in together] == alone


def test_released_slots_get_zero_keys_and_values() -> None:
    kv = SlotKV(2, 3, 1, 4, 16, torch.float32, torch.device("cpu"))
    slot = kv.allocate()
    assert slot == 0
    for k, v in zip(kv.k, kv.v, strict=True):
        k[slot, :, :5], v[slot, :, :5] = float("inf"), float("nan")
    kv.release(slot, 5)
    # SDPA adds the mask to the scores: a stale NaN or inf key would survive it, so keys are zeroed too
    assert all(torch.equal(c, torch.zeros_like(c)) for c in kv.k + kv.v)
    with pytest.raises(ValueError, match="not owned"):
        kv.release(slot)
