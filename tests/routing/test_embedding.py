"""last_token_state and embed_prompts on the tiny Llama: padding sides, adapter on, order, errors."""

from __future__ import annotations

import pytest
import torch

from adapters import AdaptedModel, LoraConfig, inject
from models import LoadedModel
from routing import RoutingError, embed_prompts, last_token_state

PROMPTS = ["hello there", "a much longer prompt about federated adapters and routing", "x y"]


@pytest.fixture()
def adapted(tiny: LoadedModel) -> AdaptedModel:
    out = inject(tiny.model)
    out.add_adapter("global", LoraConfig(r=4, alpha=8.0, dropout=0.0), seed=0)
    gen = torch.Generator().manual_seed(1)
    for _, layer in out.adapter_layers("global"):
        b = layer.adapters["global"].lora_B
        with torch.no_grad():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
        layer.invalidate_cache()
    return out


def _single(tiny: LoadedModel, adapted: AdaptedModel, prompt: str) -> torch.Tensor:
    enc = tiny.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)  # type: ignore[operator]
    return last_token_state(tiny.model, adapted, enc["input_ids"], enc["attention_mask"], ("global",))[0]


@pytest.mark.parametrize("side", ["left", "right"])
def test_last_non_pad_token_matches_unpadded_runs(tiny: LoadedModel, adapted: AdaptedModel, side: str) -> None:
    tiny.tokenizer.padding_side = side  # type: ignore[attr-defined]
    enc = tiny.tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)  # type: ignore[operator]
    assert (enc["attention_mask"] == 0).any()  # the batch really is padded
    batch = last_token_state(tiny.model, adapted, enc["input_ids"], enc["attention_mask"], ("global",))
    assert batch.shape == (3, tiny.model.config.hidden_size) and batch.dtype == torch.float32
    for row, prompt in zip(batch, PROMPTS, strict=True):
        torch.testing.assert_close(row, _single(tiny, adapted, prompt), atol=1e-5, rtol=1e-4)


def test_state_is_final_norm_output_with_global_adapter_on(tiny: LoadedModel, adapted: AdaptedModel) -> None:
    enc = tiny.tokenizer(PROMPTS[:1], return_tensors="pt", add_special_tokens=False)  # type: ignore[operator]
    on = last_token_state(tiny.model, adapted, enc["input_ids"], enc["attention_mask"], ("global",))
    off = last_token_state(tiny.model, adapted, enc["input_ids"], enc["attention_mask"])
    half = last_token_state(tiny.model, adapted, enc["input_ids"], enc["attention_mask"], ("global",),
                            torch.tensor([[0.5]]))
    assert not torch.allclose(on, off) and not torch.allclose(on, half)
    with torch.no_grad(), adapted.context.use(("global",), [[1.0]]):
        hs = tiny.model.model(input_ids=enc["input_ids"]).last_hidden_state  # after the final RMSNorm
    torch.testing.assert_close(on[0], hs[0, -1], atol=1e-5, rtol=1e-4)


def test_embed_prompts_keeps_order_and_matches_single_runs(tiny: LoadedModel, adapted: AdaptedModel) -> None:
    prompts = PROMPTS + ["one more", "and the last, rather long, prompt of the set"]
    vecs = embed_prompts(tiny.model, adapted, tiny.tokenizer, prompts, ("global",), batch_size=2)
    assert vecs.shape == (5, tiny.model.config.hidden_size)
    for vec, prompt in zip(vecs, prompts, strict=True):
        torch.testing.assert_close(torch.from_numpy(vec), _single(tiny, adapted, prompt), atol=1e-5, rtol=1e-4)
    assert embed_prompts(tiny.model, adapted, tiny.tokenizer, [], ("global",)).shape == (0, 0)


def test_errors_name_the_problem(tiny: LoadedModel) -> None:
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    with pytest.raises(RoutingError, match="at least one real token"):
        last_token_state(tiny.model, None, ids, torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(RoutingError, match=r"\(B, T\)"):
        last_token_state(tiny.model, None, ids, torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(RoutingError, match="batch_size"):
        embed_prompts(tiny.model, None, tiny.tokenizer, ["a"], batch_size=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_mean_pooling_averages_the_real_tokens_whatever_the_padding(tiny: LoadedModel, adapted: AdaptedModel,
                                                                    side: str) -> None:
    """Paper 000 Table 10's average-token embedding: padding never enters a prompt's mean."""
    tiny.tokenizer.padding_side = side  # type: ignore[attr-defined]
    vecs = embed_prompts(tiny.model, adapted, tiny.tokenizer, PROMPTS, ("global",), batch_size=3, pooling="mean")
    last = embed_prompts(tiny.model, adapted, tiny.tokenizer, PROMPTS, ("global",), batch_size=3)
    for vec, other, prompt in zip(vecs, last, PROMPTS, strict=True):
        enc = tiny.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)  # type: ignore[operator]
        with torch.no_grad(), adapted.context.use(("global",), [[1.0]]):
            hs = tiny.model.model(input_ids=enc["input_ids"]).last_hidden_state[0]  # (T, H)
        torch.testing.assert_close(torch.from_numpy(vec), hs.mean(dim=0), atol=1e-5, rtol=1e-4)
        assert not torch.allclose(torch.from_numpy(vec), torch.from_numpy(other))
    with pytest.raises(RoutingError, match="'last'.*'mean'"):
        embed_prompts(tiny.model, adapted, tiny.tokenizer, PROMPTS, ("global",), pooling="max")  # type: ignore[arg-type]
