"""The runner's packed bf16 matrices on CPU (serving.engine.runner.layout): F.linear's products, one copy, same tokens.

Under ``autocast-bf16`` the fused runner holds its own bf16 copies in oneDNN's packed form where that
form is available. Packing may change which kernel runs, never the model: products agree with
``F.linear`` under autocast, the copies are shared and remade like plain ones, and an engine decodes
the same tokens with packed or plain copies.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.kv import SlotKV
from serving.engine.request import GenerationRequest, GenerationResult
from serving.engine.runner.layout import head_logits, linear, packed_copy, packs
from serving.engine.runner.llama import LlamaRunner
from serving.engine.sampling import SamplingParams
from tests.serving.helpers import adapted_with

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not packs(CPU, torch.bfloat16),
                                   reason="oneDNN's packed bf16 linear is not available in this torch build")


@pytest.fixture()
def autocast_tiny(tiny: LoadedModel) -> LoadedModel:
    return dataclasses.replace(tiny, dtype="autocast-bf16")


def test_only_cpu_bf16_is_packed() -> None:
    assert not packs(CPU, torch.float32)
    assert not packs(torch.device("cuda"), torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 8, 64, 200])
def test_packed_linear_gives_the_products_of_f_linear_under_autocast(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen) / 8, torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)  # fp32, as the runner's norms hand it over
    packed = packed_copy(w, torch.bfloat16)
    assert packed.is_mkldnn and packed.shape == w.shape
    for bias in (None, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.linear(x, w, bias)
        got = linear(x, packed, bias)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)  # a bf16 rounding step at most
        torch.testing.assert_close(head_logits(x, packed, bias, in_major=False), want, rtol=2**-7, atol=1e-3)
    assert linear(x, w, b).dtype == torch.float32  # a plain matrix is F.linear itself


@needs_packing
def test_packed_copy_is_shared_and_remade_after_an_in_place_change() -> None:
    w = torch.randn(24, 16)
    packed = packed_copy(w, torch.bfloat16)
    assert packed_copy(w, torch.bfloat16) is packed
    x = torch.randn(3, 16)
    w.mul_(2.0)
    again = packed_copy(w, torch.bfloat16)
    assert again is not packed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(linear(x, again, None), F.linear(x, w))
    with torch.inference_mode():  # an inference tensor keeps no version: packed anew, nothing cached on it
        made = torch.randn(24, 16)
        first, second = packed_copy(made, torch.bfloat16), packed_copy(made, torch.bfloat16)
        assert first is not second and torch.equal(linear(x, first, None), linear(x, second, None))


@needs_packing
def test_the_runner_holds_one_packed_copy_and_folds_nothing(autocast_tiny: LoadedModel) -> None:
    c = autocast_tiny.model.config
    kv = SlotKV(c.num_hidden_layers, 4, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, 64,
                torch.bfloat16, CPU)
    runner = LlamaRunner(autocast_tiny.model, adapted_with(autocast_tiny), kv, autocast_tiny.autocast,
                         lora_capacity=4, lora_rank=8)
    assert runner.packed and runner.head_weight.is_mkldnn
    assert runner.slots is not None and runner.slots.folded == [{} for _ in runner.mods]
    for per in runner.weights:
        for group in ("qkv", "o", "gate_up", "down"):
            assert per[group] is not None and per[group].is_mkldnn
    fused = autocast_tiny.model.model.layers[0].self_attn.q_proj.base_layer.__dict__["_fedmosaic_fused_weight"]
    assert getattr(fused, "_fedmosaic_compute_copy", None) is None  # no plain bf16 copy besides the packed one
    assert fused._fedmosaic_packed_copy[2] is runner.weights[0]["qkv"]


def test_packed_and_plain_copies_decode_the_same_tokens(autocast_tiny: LoadedModel,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Base rows and FedDPA-like mixtures, prefilled together and decoded: the same greedy tokens either way.
    Base rows get the same log-probabilities; adapter rows add their adapters' sum with one more bf16
    rounding (packed GEMMs cannot accumulate into ``y``), as close to float32's as the plain copies'."""
    def requests() -> list[GenerationRequest]:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
        mixes = [((), ()), (("g", "l1"), (0.7, 0.3)), (("g", "l2"), (0.4, 0.6)), (("l1",), (1.0,))]
        return [GenerationRequest(prompt=f"Question {i}: name a colour and a fruit", sampling=params,
                                  adapter_names=names, adapter_weights=weights)
                for i, (names, weights) in enumerate(mixes)]

    def logprobs(results: list[GenerationResult]) -> list[torch.Tensor]:  # the prompt's: the same tokens in all
        return [torch.tensor([x.logprob for x in r.prompt_logprobs[1:]]) for r in results]  # type: ignore[index, union-attr]

    adapted = adapted_with(autocast_tiny)
    engine = Engine(autocast_tiny, adapted, EngineConfig(max_batch_size=4))
    assert engine.executor.fast is not None and engine.executor.fast.packed == packs(CPU, torch.bfloat16)
    packed = engine.generate(requests())
    monkeypatch.setattr("serving.engine.runner.llama.packs", lambda device, dtype: False)
    plain_engine = Engine(autocast_tiny, adapted, EngineConfig(max_batch_size=4))
    assert plain_engine.executor.fast is not None and not plain_engine.executor.fast.packed
    plain = plain_engine.generate(requests())
    assert [r.token_ids for r in packed] == [r.token_ids for r in plain]
    assert all(r.completion_tokens == 12 for r in packed)
    exact = Engine(dataclasses.replace(autocast_tiny, dtype="float32"), adapted, EngineConfig(max_batch_size=4))
    reference = logprobs(exact.generate(requests()))
    torch.testing.assert_close(logprobs(packed)[0], logprobs(plain)[0], rtol=0, atol=1e-4)
    for got, want, ref in zip(logprobs(packed)[1:], logprobs(plain)[1:], reference[1:], strict=True):
        assert (got - ref).abs().max() <= 2 * (want - ref).abs().max() + 1e-3


@needs_packing
def test_packed_stacks_follow_every_slot_change(autocast_tiny: LoadedModel) -> None:
    """Packed adapter stacks give the plain stacks' products (within one bf16 rounding of the sum) through
    a narrower step (padded, not repacked), a slot refilled with another adapter, a refill of the same
    name with new tensors, and a rank growth: a stale packed copy would keep the old adapter's products."""
    from adapters import LoraConfig
    from serving.engine.runner.lora_slots import LoraSlots
    from tests.serving.helpers import randomize

    adapted = adapted_with(autocast_tiny)
    adapted.add_adapter("wide", LoraConfig(r=8, alpha=8.0, dropout=0.0), seed=7)
    randomize(adapted, "wide", seed=107)
    c = autocast_tiny.model.config
    kv = SlotKV(c.num_hidden_layers, 4, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, 64,
                torch.bfloat16, CPU)
    mods = LlamaRunner(autocast_tiny.model, adapted, kv, autocast_tiny.autocast, lora_capacity=2, lora_rank=8).mods
    packed, plain = (LoraSlots(adapted, mods, 2, 8, torch.bfloat16, CPU, grow=True, packed=p) for p in (True, False))
    gen = torch.Generator().manual_seed(0)

    def check(names: tuple[str, ...], weights: list[list[tuple[int, float]]] | None = None) -> None:
        where = packed.place(names)
        assert plain.place(names) == where
        pairs = weights or [[(s, 0.5) for s in where], [(where[-1], 1.0)]]
        w = packed.weights(pairs, max(where) + 1)
        for layer in range(len(mods)):
            for group, lay in packed.layouts.items():
                x = torch.randn(2, lay.d_in, generator=gen)
                base = torch.randn(2, lay.d_out, generator=gen).to(torch.bfloat16)
                wexp = packed.expand(w, group).to(torch.bfloat16)
                got, want = base.clone(), base.clone()
                packed.apply(layer, group, x, got, wexp)
                with autocast_tiny.autocast():
                    plain.apply(layer, group, x, want, wexp)
                assert not torch.equal(got, base)  # the adapters were added
                torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-6)

    check(("g", "l1"))
    held = packed._packed[0]["qkv"]
    check(("g",), [[(0, 1.0)], [(0, 0.25)]])  # one slot of two: the packed two-slot stacks, padded
    assert packed._packed[0]["qkv"] is held
    check(("g", "l2"))  # l2 replaces l1 in slot 1
    assert packed._packed[0]["qkv"] is not held
    randomize(adapted, "l2", seed=99)  # the same name, new tensors: refilled
    check(("g", "l2"))
    check(("wide", "l1"))  # rank 4 -> 8: every stack remade
