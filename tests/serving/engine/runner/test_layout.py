"""Weight storage of the fused runner: fused views, in-feature-major order on CPU float32, the head's form.

A re-layout may change which BLAS routine runs, never the model: the HF modules keep their shapes and
values, share memory with the runner's matrices, and the model's own forward gives the same logits
before and after the runner is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import LoadedModel
from serving.engine.runner.layout import compute_copy, fuse, head_logits, in_feature_major, reorder
from serving.engine.runner.llama import LlamaRunner
from tests.serving.engine.test_engine_batching import kv_for
from tests.serving.helpers import adapted_with


def linears(seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(12, 7), nn.Linear(12, 5), nn.Linear(12, 5)]


def test_policy_is_cpu_float32_only() -> None:
    assert in_feature_major(torch.device("cpu"), torch.float32)
    assert not in_feature_major(torch.device("cpu"), torch.bfloat16)
    assert not in_feature_major(torch.device("cuda"), torch.float32)


def test_fuse_in_feature_major_keeps_values_and_shares_memory() -> None:
    lins = linears()
    before = [lin.weight.detach().clone() for lin in lins]
    x = torch.randn(3, 12)
    expected = torch.cat([F.linear(x, w) for w in before], dim=1)
    fused = fuse(lins, "weight", in_major=True)
    assert fused is not None and fused.shape == (17, 12) and fused.stride() == (1, 17)  # (in, out) storage
    for lin, w in zip(lins, before, strict=True):
        assert torch.equal(lin.weight, w) and not lin.weight.requires_grad
        assert lin.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.allclose(F.linear(x, fused), expected, atol=1e-6)
    assert fuse(lins, "weight", in_major=True) is fused  # a second engine reuses it, no new copy
    with torch.no_grad():
        lins[1].weight.add_(1.0)  # an in-place change (a merged adapter) is seen through the fusion
    assert torch.equal(fused[7:12], before[1] + 1.0)


def test_fuse_switches_storage_order_without_changing_values() -> None:
    lins = linears(1)
    before = [lin.weight.detach().clone() for lin in lins]
    major = fuse(lins, "weight", in_major=True)
    rows = fuse(lins, "weight", in_major=False)
    assert rows is not major and rows is not None and rows.is_contiguous()
    assert all(torch.equal(lin.weight, w) for lin, w in zip(lins, before, strict=True))
    biases = fuse(lins, "bias", in_major=True)  # 1-D: one order only
    assert biases is not None and torch.equal(biases, torch.cat([lin.bias for lin in lins]))


def test_reorder_both_ways() -> None:
    lin = nn.Linear(6, 4)
    w = lin.weight.detach().clone()
    assert reorder(lin, in_major=True).stride() == (1, 4) and torch.equal(lin.weight, w)
    assert reorder(lin, in_major=True) is lin.weight  # already in that order: untouched
    assert reorder(lin, in_major=False).is_contiguous() and torch.equal(lin.weight, w)


def test_head_logits_equal_linear_in_both_forms() -> None:
    torch.manual_seed(3)
    w, b, h = torch.randn(50, 8), torch.randn(50), torch.randn(4, 8)
    for bias in (None, b):
        ref = F.linear(h, w, bias)
        for major in (False, True):
            assert torch.allclose(head_logits(h, w, bias, major), ref, atol=1e-5)


def test_compute_copy_is_row_major_and_remade_after_an_in_place_change() -> None:
    w = torch.randn(5, 3).t().contiguous().t()  # in-feature-major storage
    copy = compute_copy(w, torch.bfloat16)
    assert copy.is_contiguous() and torch.equal(copy, w.to(torch.bfloat16))
    assert compute_copy(w, torch.bfloat16) is copy
    w.add_(1.0)
    assert torch.equal(compute_copy(w, torch.bfloat16), w.to(torch.bfloat16))


def test_runner_relayout_leaves_the_model_forward_unchanged(tiny: LoadedModel) -> None:
    adapted = adapted_with(tiny)
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.inference_mode(), adapted.context.single("g", 1, trainable=False):
        before = tiny.model(ids).logits
    runner = LlamaRunner(tiny.model, adapted, kv_for(tiny), tiny.autocast, lora_capacity=4, lora_rank=8)
    assert runner.in_major
    attn = tiny.model.model.layers[0].self_attn
    o = getattr(attn.o_proj, "base_layer", attn.o_proj).weight
    assert o.stride() == (1, o.shape[0])  # the HF module reads the runner's in-feature-major storage
    a_stack = runner.slots.stacks[0]["qkv"][0] if runner.slots is not None else None
    assert a_stack is not None and a_stack.stride()[0] == 1
    with torch.inference_mode(), adapted.context.single("g", 1, trainable=False):
        after = tiny.model(ids).logits
    assert torch.allclose(before, after, atol=1e-5)
