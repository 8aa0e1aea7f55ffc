"""A step that prefills and decodes runs one forward on the fused runner (issue 14), equal to its halves.

The reference is the model's own HF forward run as two calls (prefill, then decode) on its own cache;
the engine-level tests compare greedy answers with each request run alone.
"""

from __future__ import annotations

import pytest
import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.runner.hf import HFRunner
from serving.engine.runner.inputs import DecodeRow, PrefillRow
from serving.engine.runner.llama import LlamaRunner
from tests.serving.engine.test_engine_batching import MIXES, PROMPTS, kv_for, requests
from tests.serving.helpers import adapted_with


def test_a_mixed_forward_equals_its_prefill_and_decode_apart(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    hf = HFRunner(tiny.model, adapted, kv_for(tiny), tiny.autocast)
    fused = LlamaRunner(tiny.model, adapted, kv_for(tiny), tiny.autocast, lora_capacity=4, lora_rank=8)
    tokens = [tuple(tiny.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    running = [PrefillRow(i, tokens[i], 0, MIXES[i]) for i in (2, 3)]  # slots 2, 3 hold a prompt, then decode
    new = [PrefillRow(0, tokens[0], 0, MIXES[0], want_state=True, all_logits=True),
           PrefillRow(1, tokens[1][:3], 0, MIXES[1], want_state=True)]  # a whole prompt and a first chunk
    with torch.inference_mode():
        first = hf.prefill(running).logits.argmax(-1).tolist()
        fused.prefill(running)
        decode = [DecodeRow(i + 2, first[i], len(tokens[i + 2]), MIXES[i + 2]) for i in range(2)]
        want, want_next = hf.prefill(new), hf.decode(decode)
        got = fused.prefill(new, decode)
    assert got.logits.shape[0] == 4 and got.states is not None and got.state_sums is not None
    torch.testing.assert_close(got.logits[:2], want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits[2:], want_next.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.states, want.states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.state_sums, want.state_sums, atol=1e-4, rtol=1e-5)
    assert got.all_logits is not None and want.all_logits is not None and got.all_logits[1] is None
    torch.testing.assert_close(got.all_logits[0], want.all_logits[0], atol=1e-5, rtol=1e-5)


def _count_forwards(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    fast = engine.executor.fast
    assert fast is not None
    calls: list[tuple[str, int, int]] = []
    prefill, decode = fast.prefill, fast.decode

    def counting_prefill(rows, decode_rows=()):  # type: ignore[no-untyped-def]
        calls.append(("prefill", len(rows), len(decode_rows)))
        return prefill(rows, decode_rows)

    def counting_decode(rows):  # type: ignore[no-untyped-def]
        calls.append(("decode", 0, len(rows)))
        return decode(rows)

    monkeypatch.setattr(fast, "prefill", counting_prefill)
    monkeypatch.setattr(fast, "decode", counting_decode)
    return calls


def test_a_step_that_prefills_and_decodes_reads_the_weights_once(tiny: LoadedModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Every step decodes here: by default a step that starts new prompts leaves the decode to the next.
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4, max_decode_skips=0))
    reqs = requests(6)
    alone = [engine.generate([r])[0].token_ids for r in reqs]
    calls = _count_forwards(engine, monkeypatch)
    handles = [engine.submit(reqs[0]), engine.submit(reqs[1])]
    engine.step()  # prefill only
    engine.step()  # decode only
    handles += [engine.submit(reqs[2]), engine.submit(reqs[3])]
    calls.clear()
    engine.step()  # two prompts prefilled and two rows decoded: one forward
    assert calls == [("prefill", 2, 2)]
    while engine.step():
        pass
    assert [h.result().token_ids for h in handles] == alone


def test_a_failing_mixed_forward_runs_its_halves_apart(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4, max_decode_skips=0))
    reqs = requests(6)
    alone = [engine.generate([r])[0].token_ids for r in reqs]
    fast = engine.executor.fast
    assert fast is not None
    real = fast.prefill

    def no_mixing(rows, decode_rows=()):  # type: ignore[no-untyped-def]
        if decode_rows:
            raise RuntimeError("simulated failure of a mixed forward")
        return real(rows)

    monkeypatch.setattr(fast, "prefill", no_mixing)
    calls = _count_forwards(engine, monkeypatch)
    handles = [engine.submit(reqs[0])]
    engine.step()
    handles += [engine.submit(r) for r in reqs[1:]]
    calls.clear()
    engine.step()  # the mixed forward fails: the prefill and the decode run apart, nobody fails
    assert calls == [("prefill", 3, 1), ("prefill", 3, 0), ("decode", 0, 1)]
    while engine.step():
        pass
    results = [h.result() for h in handles]
    assert all(r.finish_reason == "length" for r in results) and [r.token_ids for r in results] == alone


def test_new_prompts_get_a_step_of_their_own_and_a_long_prompt_then_rides_beside_the_decode(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill-first (vLLM's order, bounded): the step that starts new prompts does not decode the running
    rows, so their first tokens come out of a prefill-only forward; a prompt still being chunked after
    its first step does not hold the decode back, its next chunks ride in the decode's forward."""
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4, max_prefill_tokens=1,
                                                           prefix_cache_slots=0))  # every prompt from its start
    reqs = requests(6)
    alone = [engine.generate([r])[0].token_ids for r in reqs]
    calls = _count_forwards(engine, monkeypatch)
    handles = [engine.submit(reqs[0])]
    while not engine._active or len(engine._active[0].output) < 2:
        engine.step()
    running = engine._active[0]
    made = len(running.output)
    handles.append(engine.submit(reqs[1]))
    calls.clear()
    engine.step()  # the new prompt's first chunk alone
    new = next(s for s in engine._active if s.handle is handles[1])
    assert calls == [("prefill", 1, 0)] and len(running.output) == made
    assert len(new.ids) >= 3 and new.filled == 1  # a chunk of one token per step
    calls.clear()
    engine.step()  # its next chunk beside the running row's decode: one forward
    assert calls == [("prefill", 1, 1)] and len(running.output) == made + 1
    while engine.step():
        pass
    assert [h.result().token_ids for h in handles] == alone[:2]


def test_adapters_beyond_the_slots_run_the_halves_apart(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(lora_slots=2))
    rows = ([PrefillRow(0, (1, 2), 0, MIXES[0])], [DecodeRow(1, 3, 4, MIXES[1])])  # g, l1 + g, l2: 3 adapters
    assert not engine.executor.fuses(*rows)
    assert engine.executor.fuses([rows[0][0]], [DecodeRow(1, 3, 4, MIXES[2])])  # g, l1 + l1
    assert not engine.executor.fuses([], rows[1]) and not engine.executor.fuses(rows[0], [])
