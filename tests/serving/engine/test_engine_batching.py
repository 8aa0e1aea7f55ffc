"""The engine's batching on the tiny model: fused runner = HF forward, chunked and batched prefill, slots.

Every test compares greedy token ids, which in float32 are identical when the logits agree to
rounding: the fused Llama runner against the model's own forward, a prompt prefilled in chunks
against one piece, requests prefilled together against each alone, and adapters mixed through the
device slot table against the layers' own per-row weights.
"""

from __future__ import annotations

import pytest
import torch

from adapters import LoraConfig, inject
from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.kv import SlotKV
from serving.engine.request import GenerationRequest
from serving.engine.runner.hf import HFRunner
from serving.engine.runner.inputs import DecodeRow, PrefillRow, RowAdapters
from serving.engine.runner.llama import LlamaRunner, unsupported_reason
from serving.engine.sampling import SamplingParams, filter_logits, sample_batch
from serving.engine.text import TextTracker
from tests.serving.helpers import adapted_with, randomize

PROMPTS = ["The capital of France is Paris and the capital of Italy is", "Sort these words",
           "twelve plus seven equals nineteen", "Convert 5 km"]
MIXES = [RowAdapters(("g", "l1"), (0.7, 0.3)), RowAdapters(("g", "l2"), (0.2, 0.8)), RowAdapters(("l1",), (1.0,)),
         RowAdapters()]


def requests(n: int = 10) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [GenerationRequest(prompt=p, sampling=params, adapter_names=m.names, adapter_weights=m.weights)
            for p, m in zip(PROMPTS, MIXES, strict=True)]


def ids(results: list) -> list[tuple[int, ...]]:  # type: ignore[type-arg]
    return [r.token_ids for r in results]


def kv_for(tiny: LoadedModel, slots: int = 4) -> SlotKV:
    c = tiny.model.config
    return SlotKV(c.num_hidden_layers, slots, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, 64,
                  torch.float32, torch.device("cpu"))


def test_fused_runner_equals_the_hf_forward_step_by_step(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    hf = HFRunner(tiny.model, adapted, kv_for(tiny), tiny.autocast)
    fused = LlamaRunner(tiny.model, adapted, kv_for(tiny), tiny.autocast, lora_capacity=4, lora_rank=8)
    tokens = [tuple(tiny.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    rows = [PrefillRow(i, t, 0, m, want_state=True) for i, (t, m) in enumerate(zip(tokens, MIXES, strict=True))]
    with torch.inference_mode():
        a, b = hf.prefill(rows), fused.prefill(rows)
        assert torch.allclose(a.logits, b.logits, atol=1e-5) and torch.allclose(a.states, b.states, atol=1e-5)
        nxt = a.logits.argmax(-1).tolist()
        for step in range(4):
            drows = [DecodeRow(i, nxt[i], len(tokens[i]) + step, MIXES[i]) for i in range(4)]
            a, b = hf.decode(drows), fused.decode(drows)
            assert torch.allclose(a.logits, b.logits, atol=1e-5)
            nxt = a.logits.argmax(-1).tolist()


def test_fused_and_hf_engines_decode_the_same_tokens(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    fused = Engine(tiny, adapted, EngineConfig(runner="fused"))
    hf = Engine(tiny, adapted, EngineConfig(runner="hf"))
    assert ids(fused.generate(requests())) == ids(hf.generate(requests()))


def test_chunked_prefill_equals_one_piece(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    whole = Engine(tiny, adapted, EngineConfig(max_prefill_tokens=512))
    chunked = Engine(tiny, adapted, EngineConfig(max_prefill_tokens=3))
    assert ids(chunked.generate(requests())) == ids(whole.generate(requests()))


def test_a_long_prompt_is_prefilled_in_bounded_chunks_while_others_decode(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_prefill_tokens=4))
    short = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=SamplingParams(
        max_tokens=200, temperature=0, ignore_eos=True)))
    engine.step()
    prompt = " ".join(PROMPTS * 3)
    long = engine.submit(GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=3, temperature=0)))
    running = next(s for s in engine._active if s.handle is short)
    made, steps = [], 0
    while not long.done:
        engine.step()
        steps += 1
        made.append(len(running.output))
    n = len(tiny.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert steps >= n // 4  # one chunk of at most 4 prompt tokens per step
    assert made == list(range(made[0], made[0] + steps))  # the short request decoded one token every step
    short.cancel()
    while engine.step():
        pass


def test_requests_prefilled_together_equal_each_alone(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4))
    alone = [engine.generate([r])[0].token_ids for r in requests()]
    assert ids(engine.generate(requests())) == alone


def test_more_requests_than_slots_wait_for_a_free_slot(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=2))
    alone = [engine.generate([r])[0].token_ids for r in requests()]
    handles = [engine.submit(r) for r in requests()]
    engine.step()
    assert engine.stats().running == 2 and engine.stats().waiting == 2
    while engine.step():
        pass
    assert [h.result().token_ids for h in handles] == alone
    assert engine.kv.free_slots == 2


def test_more_adapters_than_slots_fall_back_to_the_hf_forward(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    small = Engine(tiny, adapted, EngineConfig(lora_slots=1))
    assert small.executor.runner_name([MIXES[0]]) == "hf" and small.executor.runner_name([MIXES[2]]) == "fused"
    reference = Engine(tiny, adapted, EngineConfig(runner="hf"))
    assert ids(small.generate(requests())) == ids(reference.generate(requests()))


def test_a_reloaded_adapter_is_copied_into_its_slot_again(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    engine = Engine(tiny, adapted)
    req = requests()[2]  # l1 alone
    first = engine.generate([req])[0].token_ids
    randomize(adapted, "l1", seed=999, scale=2.0)
    reference = Engine(tiny, adapted, EngineConfig(runner="hf")).generate([req])[0].token_ids
    assert engine.generate([req])[0].token_ids == reference != first


def test_adapter_slots_grow_with_the_ranks_served_and_still_equal_the_hf_forward(tiny: LoadedModel) -> None:
    adapted = inject(tiny.model)
    for i, r in enumerate((2, 8, 16)):
        adapted.add_adapter(f"r{r}", LoraConfig(r=r, alpha=2.0 * r, dropout=0.0), seed=i)
        randomize(adapted, f"r{r}", seed=100 + i)
    fused = Engine(tiny, adapted, EngineConfig(runner="fused", max_lora_rank=8))
    reference = Engine(tiny, adapted, EngineConfig(runner="hf"))
    slots = fused.executor.fast.slots  # type: ignore[union-attr]
    assert slots is not None and slots.rank == 0 and slots.stacks[0]["qkv"][0].numel() == 0  # nothing held yet

    def reqs(*mixes: tuple[tuple[str, ...], tuple[float, ...]]) -> list[GenerationRequest]:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return [GenerationRequest(prompt=p, sampling=params, adapter_names=n, adapter_weights=w)
                for p, (n, w) in zip(PROMPTS, mixes, strict=False)]

    small = reqs((("r2",), (1.0,)))
    assert ids(fused.generate(small)) == ids(reference.generate(small)) and slots.rank == 2
    mixed = reqs((("r2", "r8"), (0.6, 0.4)), (("r8",), (1.0,)), (("r2",), (1.0,)), ((), ()))
    assert ids(fused.generate(mixed)) == ids(reference.generate(mixed)) and slots.rank == 8  # r2 refilled at rank 8
    big = reqs((("r16",), (1.0,)))  # above max_lora_rank: the HF forward serves it, the slots stay
    assert fused.executor.runner_name([RowAdapters(("r16",), (1.0,))]) == "hf"
    assert ids(fused.generate(big)) == ids(reference.generate(big)) and slots.rank == 8


def test_unsupported_models_are_named() -> None:
    assert "model type" in str(unsupported_reason(torch.nn.Linear(2, 2), 16))


def test_filter_logits_matches_a_naive_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen)
    top_k = torch.tensor([0, 3, 10, 0, 1])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.99])
    out = filter_logits(logits, top_k, top_p)
    for b in range(5):
        row = logits[b].clone()
        k = int(top_k[b])
        if k:
            row[row < torch.topk(row, k).values[-1]] = float("-inf")
        srt, order = torch.sort(row, descending=True)
        p = torch.softmax(srt, -1)
        drop = (p.cumsum(-1) - p) >= float(top_p[b])
        row[order[drop]] = float("-inf")
        assert torch.equal(torch.isinf(out[b]), torch.isinf(row))
        assert torch.equal(out[b][~torch.isinf(out[b])], logits[b][~torch.isinf(row)])


def test_sampling_follows_the_distribution_and_the_seed() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):
        counts[sample_batch(logits, [params], [gen])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.1, 0.6, 0.3]), atol=0.03)
    a = sample_batch(logits.repeat(2, 1), [params] * 2, [torch.Generator().manual_seed(5)] * 2)
    b = sample_batch(logits.repeat(2, 1), [params] * 2, [torch.Generator().manual_seed(5)] * 2)
    assert a == b


def test_greedy_rows_take_argmax_with_its_ties_nans_and_dtypes() -> None:
    """Greedy picks what torch.argmax picks (HF generate's rule): the first maximum, a NaN's index if any."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (16, 500), generator=gen).float()  # many tied maxima per row
    logits[2, 7] = float("nan")
    logits[5] = float("-inf")
    greedy = [SamplingParams(temperature=0)] * 16
    for rows in (logits, logits.bfloat16(), logits.t().contiguous().t()):  # bf16, and transposed in memory
        assert sample_batch(rows, greedy, [None] * 16) == torch.argmax(rows.float(), dim=-1).tolist()


@pytest.mark.parametrize("stop", [(), ("ab",), ("x y", "z")])
def test_incremental_text_equals_a_full_decode(tokenizer: object, stop: tuple[str, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        token_ids = torch.randint(3, len(tokenizer), (30,), generator=gen).tolist()  # type: ignore[arg-type]
        tracker = TextTracker(tokenizer, stop)
        deltas, stopped = [], False
        for t in token_ids:
            delta, stopped = tracker.push(t)
            deltas.append(delta)
            if stopped:
                break
        deltas.append("" if stopped else tracker.flush())
        full = tokenizer.decode(tracker.ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        hits = [i for i in (full.find(s) for s in stop) if i >= 0]
        want = full[: min(hits)] if hits else full
        assert "".join(deltas) == tracker.text == want


@pytest.mark.parametrize("policy", ["autocast-bf16", "bfloat16"])
def test_bf16_policies_run_fused_close_to_the_hf_forward(tiny: LoadedModel, policy: str) -> None:
    """The CPU default (fp32 weights, bf16 autocast) and a bf16 model: fused logits within bf16 rounding of HF's."""
    if policy == "bfloat16":
        tiny.model.to(torch.bfloat16)
    loaded = LoadedModel(model=tiny.model, tokenizer=tiny.tokenizer, name=tiny.name, dtype=policy)  # type: ignore[arg-type]
    adapted = adapted_with(loaded)
    fused = Engine(loaded, adapted, EngineConfig(runner="fused"))
    hf = Engine(loaded, adapted, EngineConfig(runner="hf"))
    assert fused.kv.dtype == torch.bfloat16
    tokens = [tuple(tiny.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    rows = [PrefillRow(i, t, 0, m) for i, (t, m) in enumerate(zip(tokens, MIXES, strict=True))]
    with torch.inference_mode():
        a = hf.executor.hf.prefill(rows).logits.float()
        b = fused.executor.fast.prefill(rows).logits.float()  # type: ignore[union-attr]
    assert (a - b).abs().max() <= 0.05 * a.abs().max()
    results = fused.generate(requests(6))
    assert all(r.finish_reason == "length" and r.completion_tokens == 6 for r in results)


@pytest.mark.parametrize("runner", ["fused", "hf"])
@pytest.mark.parametrize("chunk", [3, 512])
def test_a_mean_pooled_route_gets_the_mean_of_its_prompts_states(tiny: LoadedModel, runner: str, chunk: int) -> None:
    """Paper 000 Table 10 at serving time: the routing hook sees the mean over the prompt, whatever the chunks
    and the rows prefilled beside it, equal to the index builder's mean (``routing.embedding``)."""
    from routing.embedding import embed_prompts

    adapted = adapted_with(tiny)
    engine = Engine(tiny, adapted, EngineConfig(runner=runner, max_prefill_tokens=chunk))  # type: ignore[arg-type]
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def hook(prompt: str, pooling: str):  # noqa: ANN202 - a weight_fn
        def fn(state: torch.Tensor, ids: object) -> tuple[tuple[float, ...], dict]:
            seen.setdefault(prompt, {})[pooling] = state
            return (1.0, 0.0), {}
        return fn

    params = SamplingParams(max_tokens=2, temperature=0.0)
    reqs = [GenerationRequest(prompt=p, sampling=params, adapter_names=("g", "l1"), adapter_weights=(1.0, 0.0),
                              prefill_weights=(1.0, 0.0), weight_fn=hook(p, pooling), state_pooling=pooling)
            for p in PROMPTS[:3] for pooling in ("last", "mean")]
    engine.generate(reqs)
    with torch.inference_mode():
        for pooling in ("last", "mean"):
            ref = embed_prompts(tiny.model, adapted, tiny.tokenizer, PROMPTS[:3], ("g",), pooling=pooling)  # type: ignore[arg-type]
            for p, vec in zip(PROMPTS[:3], ref, strict=True):
                torch.testing.assert_close(seen[p][pooling], torch.from_numpy(vec), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(seen[PROMPTS[0]]["last"], seen[PROMPTS[0]]["mean"])


def _burst(engine: Engine) -> tuple[list[int], list[list[int]]]:
    """A running request, then a burst of prompts beyond the budget: its output length after each step."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    running = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=params))
    engine.step()
    seq = next(s for s in engine._active if s.handle is running)
    burst = [engine.submit(GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=4, temperature=0,
                                                                              ignore_eos=True)))
             for p in PROMPTS[1:]]
    made = []
    while not all(h.done for h in burst):
        engine.step()
        made.append(len(seq.output))
    while engine.step():
        pass
    return made, [list(h.result().token_ids) for h in [running, *burst]]


def test_a_burst_is_prefilled_before_the_running_rows_decode_within_the_skip_bound(tiny: LoadedModel) -> None:
    # Each burst prompt fits the budget alone, not all together: prefill-first steps skip the decode.
    budget = max(len(tiny.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS[1:])
    adapted = adapted_with(tiny)
    first = Engine(tiny, adapted, EngineConfig(max_prefill_tokens=budget, max_decode_skips=2))
    made, out_first = _burst(first)
    # The running row has its first token (its prefill step). Steps that start prompts do not decode:
    # the first burst step leaves a prompt unstarted, the second starts it, the third decodes.
    assert made[:3] == [1, 1, 2]
    every = Engine(tiny, adapted, EngineConfig(max_prefill_tokens=budget, max_decode_skips=0))
    made0, out_every = _burst(every)
    assert made0[:2] == [2, 3]  # without skips the running row decodes every step
    assert out_first == out_every  # the order of steps never changes a greedy answer


def test_decoding_skips_at_most_max_decode_skips_steps_in_a_row(tiny: LoadedModel) -> None:
    one = len(tiny.tokenizer(PROMPTS[3], add_special_tokens=False)["input_ids"])
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_prefill_tokens=one, max_decode_skips=2))
    running = engine.submit(GenerationRequest(prompt=PROMPTS[1], sampling=SamplingParams(
        max_tokens=60, temperature=0, ignore_eos=True)))
    engine.step()
    seq = next(s for s in engine._active if s.handle is running)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    burst = [engine.submit(GenerationRequest(prompt=PROMPTS[3], sampling=params)) for _ in range(7)]
    made = []
    while not all(h.done for h in burst):
        engine.step()
        made.append(len(seq.output))
    # One burst prompt per step: two steps without decoding, then one that decodes, and so on.
    assert made[:6] == [1, 1, 2, 2, 2, 3]
    running.cancel()
    while engine.step():
        pass


def test_max_decode_skips_is_validated() -> None:
    with pytest.raises(ValueError, match="max_decode_skips"):
        EngineConfig(max_decode_skips=-1)
