"""LoRA dropout's masks (``adapters.dropout``): the rate and scaling of ``nn.Dropout``, a fresh mask per
adapter, the same masks eager and under ``torch.compile`` for one seed, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from adapters import AdapterContext, LoraConfig
from adapters.dropout import LoraDropout, drop_threshold, lora_dropout, lora_dropout_rows, random_words
from adapters.layer import MultiLoraLinear


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_the_drop_rate_and_the_scaling_are_those_of_inverted_dropout(p: float) -> None:
    torch.manual_seed(0)
    n = 2_000_001  # odd: the last word of the last 64-bit draw is cut off
    y = lora_dropout(torch.ones(n), p)
    dropped = (y == 0).double().mean().item()
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / n)  # 6 sigma of a binomial share
    kept = y[y != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (1.0 - p)))


def test_the_threshold_drops_round_p_times_2_32_of_the_words() -> None:
    assert drop_threshold(0.0) == -(2**31)  # no word is below the smallest int32
    assert drop_threshold(0.5) == 0
    assert drop_threshold(0.05) - (-(2**31)) == round(0.05 * 2**32)


def test_each_call_draws_a_new_mask_and_one_seed_repeats_them() -> None:
    x = torch.ones(4096)
    torch.manual_seed(1)
    a, b = lora_dropout(x, 0.5), lora_dropout(x, 0.5)
    torch.manual_seed(1)
    assert not torch.equal(a, b)
    torch.testing.assert_close(lora_dropout(x, 0.5), a, rtol=0, atol=0)


def test_the_gradient_passes_the_kept_elements_scaled() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, requires_grad=True)
    g = torch.randn(3, 7, 16)
    y = lora_dropout(x, 0.3)
    (y * g).sum().backward()
    keep = (y != 0).float()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, g * keep / 0.7)


def test_evaluation_and_p_zero_are_the_identity() -> None:
    x = torch.randn(5, 8)
    assert lora_dropout(x, 0.3, training=False) is x
    assert lora_dropout(x, 0.0) is x
    module = LoraDropout(0.3).eval()
    assert module(x) is x
    assert "p=0.3" in repr(module)


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan")])
def test_a_probability_outside_0_1_is_refused(p: float) -> None:
    with pytest.raises(ValueError, match="dropout probability"):
        lora_dropout(torch.ones(3), p)
    with pytest.raises(ValueError, match="dropout probability"):
        LoraDropout(p)


def test_the_words_are_uniform_32_bit_draws_of_any_length() -> None:
    torch.manual_seed(0)
    for n in (1, 5, 4096):  # odd lengths cut the last 64-bit draw in half
        words = random_words(torch.empty(n, 1))
        assert words.shape == (n, 1) and words.dtype == torch.int32
    words = random_words(torch.empty(1_000_000)).double()
    # uniform over [-2**31, 2**31): mean 0 and sd 2**32 / sqrt(12), both sides of zero, both parities
    assert abs(words.mean().item()) < 6 * 2**32 / math.sqrt(12) / 1000
    assert (words < 0).double().mean().item() == pytest.approx(0.5, abs=0.003)
    assert (words.remainder(2) == 1).double().mean().item() == pytest.approx(0.5, abs=0.003)


def two_adapter_layer() -> MultiLoraLinear:
    torch.manual_seed(0)
    layer = MultiLoraLinear(torch.nn.Linear(64, 48), AdapterContext(), "layer")
    for name in ("global", "local"):
        layer.add_adapter(name, LoraConfig(r=4, alpha=8, dropout=0.5))
        torch.nn.init.normal_(layer.adapters[name].lora_B)
    return layer.train()


def test_a_compiled_layer_draws_the_eager_masks_one_per_adapter() -> None:
    """Same seed, same masks, same gradients; before, inductor drew its own, and one mask for both
    adapters would also pass the first check but not the second (the masks differ per adapter)."""
    layer = two_adapter_layer()
    x = torch.randn(3, 9, 64)

    def step(fn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(7)
        layer.zero_grad()
        with layer.context.uniform(("global", "local"), (1.0, 1.0), trainable=("global", "local")):
            y = fn(x)
        y.pow(2).sum().backward()
        return y.detach(), layer.adapters["local"].lora_A.grad.clone()  # type: ignore[union-attr]

    eager_y, eager_grad = step(layer)
    compiled_y, compiled_grad = step(torch.compile(layer, dynamic=True))
    torch.testing.assert_close(compiled_y, eager_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-4, rtol=1e-4)

    # the two adapters' inputs were dropped with different masks: with one shared mask the update would
    # equal the one computed from a single dropped input
    torch.manual_seed(7)
    shared = lora_dropout(x, 0.5)
    with torch.no_grad():
        one_mask = layer.base_layer(x) + sum(
            (shared @ ad.lora_A.T) @ ad.lora_B.T * ad.scaling for ad in layer.adapters.values())
    assert not torch.allclose(eager_y, one_mask, atol=1e-3)


def test_the_gathered_path_drops_each_pair_at_its_adapters_rate_and_compiles_to_the_eager_masks() -> None:
    """Rows 0 and 2 use ``global`` (p = 0.5) only, row 1 ``local`` (p = 0) only: the layer gathers the pairs.
    Before, this path drew ``torch.rand_like`` masks, which a compiled layer draws differently."""
    layer = two_adapter_layer()
    layer.adapters["local"].config = LoraConfig(r=4, alpha=8, dropout=0.0)
    x = torch.randn(3, 9, 64)
    weights = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])

    def step(fn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        layer.zero_grad()
        with layer.context.use(("global", "local"), weights, trainable=("global", "local")):
            y = fn(x)
        y.pow(2).sum().backward()
        return y.detach(), layer.adapters["global"].lora_A.grad.clone()  # type: ignore[union-attr]

    eager_y, eager_grad = step(layer)
    with torch.no_grad():
        clean = {n: layer.base_layer(x) + (x @ ad.lora_A.T) @ ad.lora_B.T * ad.scaling
                 for n, ad in layer.adapters.items()}
    torch.testing.assert_close(eager_y[1], clean["local"][1])  # p = 0: nothing dropped
    assert not torch.allclose(eager_y[0], clean["global"][0], atol=1e-3)  # p = 0.5: dropped
    torch.manual_seed(3)  # the pairs (0, global), (1, local), (2, global) in row order, one draw
    words = random_words(torch.empty(3, 9, 64))
    kept = (words[[0, 2]] >= drop_threshold(0.5)).float() * 2.0
    ad = layer.adapters["global"]
    with torch.no_grad():
        expected = layer.base_layer(x[[0, 2]]) + ((x[[0, 2]] * kept) @ ad.lora_A.T) @ ad.lora_B.T * ad.scaling
    torch.testing.assert_close(eager_y[[0, 2]], expected)
    compiled_y, compiled_grad = step(torch.compile(layer, dynamic=True))
    torch.testing.assert_close(compiled_y, eager_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-4, rtol=1e-4)


def test_per_row_rates_are_checked_and_all_zero_is_the_identity() -> None:
    x = torch.randn(2, 5)
    assert lora_dropout_rows(x, [0.0, 0.0], torch.tensor([0, 1])) is x
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        lora_dropout_rows(x, [0.1, 1.0], torch.tensor([0, 1]))
