"""MultiLoraLinear against a naive per-row loop: dense, gathered, per-token, mixed ranks, gradients."""

from __future__ import annotations

import pytest
import torch

from adapters import AdapterContext, AdapterError, LoraConfig, MultiLoraLinear

NAMES = ("g", "a", "b", "c")


def make_layer(ranks: tuple[int, ...] = (4, 2, 8, 4), seed: int = 0) -> MultiLoraLinear:
    torch.manual_seed(seed)
    layer = MultiLoraLinear(torch.nn.Linear(12, 10), AdapterContext(), "layer")
    layer.eval()
    for name, r in zip(NAMES, ranks, strict=True):
        layer.add_adapter(name, LoraConfig(r=r, alpha=2.0 * r + 1))
        torch.nn.init.normal_(layer.adapters[name].lora_B)
    return layer


def naive(layer: MultiLoraLinear, x: torch.Tensor, names: tuple[str, ...], w: torch.Tensor) -> torch.Tensor:
    """The contract, literally: y[b] = W0 x[b] + sum_k w[b,k] s_k B_k A_k x[b], one row at a time."""
    y = layer.base_layer(x).clone()
    for b in range(x.shape[0]):
        for k, name in enumerate(names):
            ad = layer.adapters[name]
            wk = w[b, :, k].unsqueeze(-1) if w.dim() == 3 else w[b, k]
            y[b] = y[b] + wk * ad.scaling * (x[b] @ ad.lora_A.T) @ ad.lora_B.T
    return y


@pytest.mark.parametrize(
    "weights",
    [
        [[1, 0, 0, 0]] * 4,  # one shared adapter: dense path
        [[0.7, 0.3, 0, 0], [0.5, 0, 0.5, 0], [0.2, 0, 0, 0.8], [1, 0, 0, 0]],  # FedDPA: shared + gathered
        [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0]],  # one local per row: gathered only
        [[0, 0, 0, 0], [0, 0.4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # zero rows: base
        [[-0.5, 2.0, 0, 0]] * 4,  # arbitrary real weights
    ],
)
def test_per_row_weights_equal_naive_loop(weights: list[list[float]]) -> None:
    layer = make_layer()
    x = torch.randn(4, 5, 12)
    w = torch.tensor(weights, dtype=torch.float32)
    with layer.context.use(NAMES, w):
        got = layer(x)
    torch.testing.assert_close(got, naive(layer, x, NAMES, w), atol=1e-5, rtol=1e-5)


def test_per_token_weights_equal_naive_loop() -> None:
    layer = make_layer()
    x = torch.randn(3, 6, 12)
    w = torch.rand(3, 6, 4)
    w[1, :, 2] = 0.0  # adapter b unused by row 1: exercises the gathered path per token
    w[:, :, 3] = 0.0
    w[0, 2, 3] = 0.9
    with layer.context.use(NAMES, w):
        got = layer(x)
    torch.testing.assert_close(got, naive(layer, x, NAMES, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", [[[1.0, 0, 0, 0]] * 3, [[0.7, 0.3, 0, 0], [0, 0, 1.0, 0], [0.5, 0, 0, 0.5]]])
def test_bf16_model_with_fp32_adapters(weights: list[list[float]]) -> None:
    """A model cast to bf16 (``--dtype bfloat16``) keeps fp32 adapters: they run in bf16, gradients reach them."""
    layer = make_layer()
    x = torch.randn(3, 5, 12)
    w = torch.tensor(weights)
    expected = naive(layer, x, NAMES, w)
    layer.base_layer.to(torch.bfloat16)
    with layer.context.use(NAMES, w):
        got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16 and layer.adapters["g"].lora_A.dtype == torch.float32
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)
    with layer.context.use(NAMES, w):  # the cached bf16 stacks are reused and stay equal
        torch.testing.assert_close(layer(x.bfloat16()), got)
    layer.train()
    with layer.context.use(NAMES, w):
        layer(x.bfloat16()).float().sum().backward()
    grad = layer.adapters["g"].lora_B.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0


def test_zero_weights_and_no_context_are_the_base_layer() -> None:
    layer = make_layer()
    x = torch.randn(2, 3, 12)
    base = layer.base_layer(x)
    torch.testing.assert_close(layer(x), base)
    with layer.context.use(NAMES, torch.zeros(2, 4)):
        torch.testing.assert_close(layer(x), base)
    with layer.context.base():
        torch.testing.assert_close(layer(x), base)


def test_two_dimensional_input_and_beam_repetition() -> None:
    layer = make_layer()
    x = torch.randn(6, 12)  # 2 rows x 3 beams, no time axis
    w = torch.tensor([[1.0, 0, 0, 0], [0, 0, 1.0, 0]])
    with layer.context.use(NAMES, w):
        got = layer(x)
    expect = naive(layer, x.unsqueeze(1), NAMES, w.repeat_interleave(3, dim=0)).squeeze(1)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


def test_gradients_reach_only_trainable_adapters() -> None:
    layer = make_layer()
    layer.train()
    x = torch.randn(4, 3, 12)
    w = torch.tensor([[0.5, 0.5, 0, 0], [0.5, 0, 0.5, 0], [0.5, 0.5, 0, 0], [0.5, 0, 0.5, 0]])
    with layer.context.use(NAMES, w, trainable=("a",)):
        layer(x).sum().backward()
    grads = {n: layer.adapters[n].lora_B.grad for n in NAMES}
    assert grads["a"] is not None and grads["a"].abs().sum() > 0
    for name in ("g", "b", "c"):
        assert grads[name] is None or grads[name].abs().sum() == 0, name


def test_detached_adapter_still_contributes() -> None:
    layer = make_layer()
    x = torch.randn(2, 3, 12)
    w = torch.tensor([[0.5, 0.5, 0, 0]] * 2)
    with layer.context.use(NAMES, w):
        full = layer(x)
    with layer.context.use(NAMES, w, trainable=("a",)):
        partial = layer(x)
    torch.testing.assert_close(full, partial)


def test_merge_matches_unmerged_and_restores_exactly() -> None:
    layer = make_layer()
    x = torch.randn(3, 4, 12)
    original = layer.base_layer.weight.detach().clone()
    with layer.context.use(("a",), torch.ones(3, 1)):
        unmerged = layer(x)
    layer.merge("a")
    torch.testing.assert_close(layer(x), unmerged, atol=1e-5, rtol=1e-5)
    with layer.context.use(("a",), torch.ones(3, 1)):
        torch.testing.assert_close(layer(x), unmerged, atol=1e-5, rtol=1e-5)
    with pytest.raises(AdapterError, match="merged"):
        with layer.context.use(("a", "b"), torch.tensor([[1.0, 0], [0, 1.0], [1.0, 0]])):
            layer(x)
    with pytest.raises(AdapterError, match="unmerge"):
        layer.delete_adapter("a")
    layer.unmerge()
    assert torch.equal(layer.base_layer.weight, original)


def test_weight_shape_errors() -> None:
    layer = make_layer()
    ctx = layer.context
    with pytest.raises(AdapterError, match="columns"):
        with ctx.use(NAMES, torch.ones(2, 3)):
            pass
    with pytest.raises(AdapterError, match=r"\(B, K\) or \(B, T, K\)"):
        with ctx.use(NAMES, torch.ones(4)):
            pass
    with pytest.raises(AdapterError, match="NaN"):
        with ctx.use(NAMES, torch.tensor([[float("nan"), 0, 0, 0]])):
            pass
    with pytest.raises(AdapterError, match="unique"):
        with ctx.use(("g", "g"), torch.ones(1, 2)):
            pass
    with pytest.raises(AdapterError, match="rows"):
        with ctx.use(NAMES, torch.ones(3, 4)):
            layer(torch.randn(4, 2, 12))
    with pytest.raises(AdapterError, match="tokens"):
        with ctx.use(NAMES, torch.ones(2, 5, 4)):
            layer(torch.randn(2, 3, 12))


def test_set_weights_validates_shape_and_values() -> None:
    layer = make_layer()
    with pytest.raises(AdapterError, match=r"expects lora_A \(4, 12\)"):
        layer.set_weights("g", torch.zeros(4, 11), torch.zeros(10, 4))
    with pytest.raises(AdapterError, match="NaN or inf"):
        layer.set_weights("g", torch.full((4, 12), float("inf")), torch.zeros(10, 4))
    with pytest.raises(AdapterError, match="no adapter"):
        layer.set_weights("zzz", torch.zeros(4, 12), torch.zeros(10, 4))


def test_config_validation() -> None:
    with pytest.raises(AdapterError, match="r must be a positive integer"):
        LoraConfig(r=0)
    with pytest.raises(AdapterError, match="alpha"):
        LoraConfig(alpha=-1)
    with pytest.raises(AdapterError, match="dropout"):
        LoraConfig(dropout=1.0)
    with pytest.raises(AdapterError, match="target_modules"):
        LoraConfig(target_modules=())
    assert LoraConfig(r=4, alpha=8).scaling == 2.0
    assert LoraConfig(r=4, alpha=8, use_rslora=True).scaling == 4.0
    assert LoraConfig(target_modules=["q_proj"]).target_modules == ("q_proj",)
