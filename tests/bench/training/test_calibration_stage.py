"""``bench.training.calibration_stage`` times FedDPA's calibration stage: the matmul FLOPs it counts for the instance
embeddings are those torch counts in ``embed_prompts``'s forwards, and its equality check compares the saved
index with each prompt embedded alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from adapters import LoraConfig
from bench.training import calibration_stage as bench
from bench.training import step_flops as flops
from models.tiny import tiny_llama
from routing.embedding import embed_prompts
from training.data import generate_suite
from training.federation.personalize import instance_prompts
from training.local.runtime import Runtime, TrainConfig


@pytest.mark.parametrize(("targets", "batch_size"), [(("q_proj", "v_proj"), 16), (("up_proj", "o_proj"), 3)])
def test_embed_flops_are_what_torch_counts_in_embed_prompts(targets: tuple[str, ...], batch_size: int) -> None:
    lora = LoraConfig(dropout=0.0, target_modules=targets)
    rt = Runtime(tiny_llama(), TrainConfig(lora=lora))
    bench.random_global(rt, seed=1)
    client = generate_suite(seed=0, n_train=11, n_test=1).clients[0]
    prompts = instance_prompts(client, rt.tokenizer, rt.train.prompt_style)
    lengths = [len(ids) for ids in rt.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    assert len(set(lengths)) > 1  # the batches pad
    with FlopCounterMode(display=False) as counted:
        embed_prompts(rt.model, rt.adapted, rt.tokenizer, prompts, ("global",), batch_size=batch_size)
    shape = flops.DecoderShape.of(rt.loaded.model.config)
    assert counted.get_total_flops() == flops.embed_flops(shape, lengths, lora, batch_size)["linear"]


def test_the_stage_saves_what_each_prompt_alone_embeds() -> None:
    rt = Runtime(tiny_llama(), TrainConfig(lora=LoraConfig(dropout=0.0)))
    bench.random_global(rt, seed=2)
    client = generate_suite(seed=0, n_train=12, n_test=1).clients[1]
    row = bench.client_stage(rt, client, flops.DecoderShape.of(rt.loaded.model.config), check=5)
    assert row["prompts"] == 12 and row["check"]["prompts"] == 5
    assert row["check"]["max_rel_diff"] < 1e-5  # float32: batching and padding change only the summation order
    # the random adapter changes the states, so the check compares adapted embeddings
    prompt = instance_prompts(client, rt.tokenizer, rt.train.prompt_style)[0]
    adapted = bench.alone(rt, prompt)
    rt.set("global", {k: torch.zeros_like(v) for k, v in rt.get("global").items()})
    assert abs(adapted - bench.alone(rt, prompt)).max() > 1e-4

