"""The engine under the default dtype policy, ``autocast-bf16`` (fp32 weights, bf16 compute and KV cache).

The other engine tests run the tiny model in float32, where every tensor already has the cache's dtype;
SmolLM2 is served with ``autocast-bf16`` by default (``FEDMOSAIC_DTYPE``), so the same paths run here on
the tiny model with that policy.
"""

from __future__ import annotations

import dataclasses

import pytest

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from tests.serving.helpers import adapted_with

# Regression: found by bench/serving/throughput.py on SmolLM2, every request failed with 500 under the
# default dtype (reference kernels wrote fp32 rotated keys into the bf16 cache and masked bf16 scores
# with the float32 minimum).


@pytest.fixture()
def autocast_tiny(tiny: LoadedModel) -> LoadedModel:
    """The tiny model under the default serving policy: fp32 weights, bf16 autocast, bf16 KV cache."""
    return dataclasses.replace(tiny, dtype="autocast-bf16")


@pytest.mark.parametrize("names", [(), ("g", "l1")])
def test_autocast_requests_complete(autocast_tiny: LoadedModel, names: tuple[str, ...]) -> None:
    """Base and adapter requests finish normally (not 500) when the engine computes in bf16."""
    engine = Engine(autocast_tiny, adapted_with(autocast_tiny), EngineConfig(max_batch_size=4))
    assert engine.kv.k[0].dtype.is_floating_point and str(engine.kv.k[0].dtype) == "torch.bfloat16"
    weights = tuple(1.0 / len(names) for _ in names)
    requests = [GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                  adapter_names=names, adapter_weights=weights)
                for p in ("The capital of France is", "Sort these words")]
    results = engine.generate(requests)
    assert [(r.finish_reason, r.error, r.completion_tokens) for r in results] == [("length", None, 6)] * 2


def test_folded_a_stacks_give_the_products_of_separate_ones(autocast_tiny: LoadedModel,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast-bf16 without oneDNN's packed form the slots keep each A stack under the group's plain
    compute copy ([W; A], one GEMM): the same base output and the same adapter products as two GEMMs over
    separate stacks, bit for bit, through a rank growth that remakes [W; A]; and the runner's own copy is
    freed (one copy in memory)."""
    import torch

    monkeypatch.setattr("serving.engine.runner.llama.packs", lambda device, dtype: False)
    import torch.nn.functional as F

    from adapters import LoraConfig
    from serving.engine.kv import SlotKV
    from serving.engine.runner.llama import LlamaRunner
    from serving.engine.runner.lora_slots import LoraSlots
    from tests.serving.helpers import randomize

    adapted = adapted_with(autocast_tiny)
    adapted.add_adapter("wide", LoraConfig(r=8, alpha=8.0, dropout=0.0), seed=7)
    randomize(adapted, "wide", seed=107)
    c = autocast_tiny.model.config
    kv = SlotKV(c.num_hidden_layers, 4, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, 64,
                torch.bfloat16, torch.device("cpu"))
    runner = LlamaRunner(autocast_tiny.model, adapted, kv, autocast_tiny.autocast, lora_capacity=4, lora_rank=8,
                         grow_rank=True)
    slots = runner.slots
    assert slots is not None and set(slots.folded[0]) == set(slots.layouts) and "qkv" not in runner.weights[0]
    fused = autocast_tiny.model.model.layers[0].self_attn.q_proj.base_layer.__dict__["_fedmosaic_fused_weight"]
    assert getattr(fused, "_fedmosaic_compute_copy", None) is None  # the slots' [W; A] is the only bf16 copy
    separate = LoraSlots(adapted, runner.mods, 4, 8, torch.bfloat16, torch.device("cpu"), grow=True)
    gen = torch.Generator().manual_seed(0)
    for names in (("g", "l1"), ("g", "l2", "wide")):  # rank 4, then 8: [W; A] is remade with W kept
        where = slots.place(names)
        assert separate.place(names) == where
        w = slots.weights([[(s, 0.5) for s in where], [(where[-1], 1.0)]], max(where) + 1)
        for layer in range(len(runner.mods)):
            for group, lay in slots.layouts.items():
                W = slots.folded[layer][group][0][: lay.d_out]
                x = torch.randn(2, lay.d_in, generator=gen).to(torch.bfloat16)
                wexp = slots.expand(w, group).to(torch.bfloat16)
                with autocast_tiny.autocast():
                    got = slots.linear(layer, group, x, wexp)
                    base = slots.linear(layer, group, x, None)
                    want = F.linear(x, W)
                    assert torch.equal(base, want)
                    separate.apply(layer, group, x, want, wexp)
                assert torch.equal(got, want) and not torch.equal(got, base)  # the adapters were added
        assert torch.equal(slots.folded[0]["qkv"][0][: fused.shape[0]], fused.to(torch.bfloat16))
