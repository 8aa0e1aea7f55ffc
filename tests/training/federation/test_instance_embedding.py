"""The calibration stage's embeddings: batched through the decoder alone, equal to the full model's per prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters import LoraConfig
from models import tiny_llama
from routing.embedding import embed_prompts, pool_states
from training.data import generate_suite
from training.federation.personalize import background_prompts, background_states, instance_prompts
from training.local.runtime import Runtime, TrainConfig

DATA = generate_suite(n_train=12, n_test=1, families=["sorting", "capitals"]).clients[0]


def _runtime() -> Runtime:
    rt = Runtime(tiny_llama(), TrainConfig(lora=LoraConfig(dropout=0.0)))
    gen = torch.Generator().manual_seed(4)
    state = rt.fresh("global", 0)
    rt.set("global", {k: torch.randn(v.shape, generator=gen) * 0.3 if k.endswith("lora_B") else v
                      for k, v in state.items()})
    return rt


def _one_by_one(rt: Runtime, prompts: list[str], pooling: str) -> np.ndarray:
    """Today's reference: the full causal LM on each prompt alone, ``hidden_states[-1]`` pooled."""
    rows = []
    for p in prompts:
        enc = rt.tokenizer(p, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode(), rt.adapted.context.use(("global",), torch.ones(1, 1)):
            out = rt.model(**enc, output_hidden_states=True)
        rows.append(pool_states(out.hidden_states[-1], enc["attention_mask"], pooling)[0].numpy())  # type: ignore[arg-type]
    return np.stack(rows)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_embeddings_equal_the_full_model_per_prompt(pooling: str) -> None:
    rt = _runtime()
    prompts = instance_prompts(DATA, rt.tokenizer, rt.train.prompt_style)
    calls = []
    hook = rt.model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        got = embed_prompts(rt.model, rt.adapted, rt.tokenizer, prompts, ("global",), batch_size=5, pooling=pooling)
    finally:
        hook.remove()
    assert calls == []  # the head (logits over every position) never runs for an embedding
    np.testing.assert_allclose(got, _one_by_one(rt, prompts, pooling), rtol=1e-4, atol=1e-5)


def test_background_states_are_embedded_once_per_global_adapter() -> None:
    rt = _runtime()
    first = background_states(rt)
    reference = _one_by_one(rt, background_prompts(rt.tokenizer, rt.train.prompt_style)[:7], "last")
    np.testing.assert_allclose(first[:7], reference, rtol=1e-4, atol=1e-5)
    assert background_states(rt) is first  # the same adapter: not embedded again
    state = rt.get("global")
    rt.set("global", {k: v * 2 if k.endswith("lora_B") else v for k, v in state.items()})
    second = background_states(rt)
    assert second is not first and not np.allclose(second, first)
