"""``bench.training.round`` counts the work each loop trains on exactly: its replay of a local run's shuffle and
micro-batches gives the real and padded tokens the trainer's forwards actually see, and ``bench.training.step_flops``
the matmul FLOPs torch counts in each loop's forwards and backwards."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from adapters import LoraConfig
from bench.training import plain_peft
from bench.training import round as bench
from bench.training import step_flops as flops
from models import LoadedModel
from models.tiny import tiny_llama
from training.data import Example, collate, generate_suite
from training.local.lm_forward import lm_forward
from training.local.micro_batches import packs, step_batches
from training.local.runtime import Runtime, TrainConfig
from training.local.train import length_grouped, lm_loss, train_adapters
from training.state import derive_seed


def _shape(loaded: LoadedModel) -> flops.DecoderShape:
    return flops.DecoderShape.of(loaded.model.config)


def _spread(examples: list[Example]) -> list[Example]:
    """The examples with lengths spread 1x-6x, so length grouping changes the micro-batches."""
    out = []
    for k, e in enumerate(examples):
        times = 1 + k % 6
        out.append(Example(e.input_ids * times, e.labels * times))
    return out


def test_drawn_work_is_what_the_trainer_forwards(tiny: LoadedModel) -> None:
    train = TrainConfig(batch_size=6, micro_batch_size=2, max_steps=5, cutoff_len=512, lr=1e-3,
                        lora=LoraConfig(dropout=0.0))
    rt = Runtime(tiny, train)
    client = generate_suite(seed=0, n_train=14, n_test=1).clients[0]
    examples = _spread(list(rt.examples(client)))
    seen: list[dict[str, torch.Tensor]] = []

    @length_grouped
    def recording(runtime, batch, names, weights):  # noqa: ANN001, ANN202 - the trainer's LossFn
        seen.append(batch)
        return lm_loss(runtime, batch, names, weights)

    seed = derive_seed(3, 1, client.client_id, "global")
    rt.set("global", rt.fresh("global", 1))
    train_adapters(rt, examples, ["global"], ["global"], [1.0], seed=seed, loss_fn=recording)
    pad, shape = rt.tokenizer.pad_token_id, _shape(tiny)
    work = bench.drawn_work(examples, train, seed, pad, shape, rt.device, packed=packs(rt.device, rt.model))
    tokens, padded = work.tokens, work.padded
    assert padded == sum(int(b["input_ids"].numel()) for b in seen)
    assert tokens == sum(int(b["attention_mask"].sum()) for b in seen)
    # the plain split (the plain loop's): each micro-batch of the draw padded to its longest
    gen, order, plain_padded = torch.Generator().manual_seed(seed), [], 0
    for _ in range(train.max_steps):
        if len(order) < train.batch_size:
            order += torch.randperm(len(examples), generator=gen).tolist()
        idx, order = order[: train.batch_size], order[train.batch_size:]
        for s in range(0, len(idx), train.micro_batch_size):
            micro = [examples[i] for i in idx[s:s + train.micro_batch_size]]
            plain_padded += int(collate(micro, pad_id=pad)["input_ids"].numel())
    plain = bench.drawn_work(examples, train, seed, pad, shape, rt.device, by_length=False)
    assert (plain.tokens, plain.padded) == (tokens, plain_padded)
    assert plain_padded > padded  # packing (or grouping by length) pads less on this spread


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("gate_proj", "down_proj"), ("o_proj",),
                                     ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")])
@pytest.mark.parametrize("packed", [True, False])
def test_step_flops_are_what_torch_counts_in_each_loops_forward_and_backward(targets: tuple[str, ...],
                                                                             packed: bool) -> None:
    # ours: packed or length-grouped micro-batches, the head on the labelled positions only; the plain PEFT
    # loop: the plain split, the head on every position. torch's FlopCounterMode counts every mm either runs.
    train = TrainConfig(batch_size=6, micro_batch_size=2, max_steps=1, cutoff_len=512, lr=1e-3,
                        lora=LoraConfig(dropout=0.0, target_modules=targets))
    rt = Runtime(tiny_llama(), train)
    shape = _shape(rt.loaded)
    examples = _spread(list(rt.examples(generate_suite(seed=0, n_train=6, n_test=1).clients[0])))
    pad = rt.tokenizer.pad_token_id
    rt.set("global", rt.fresh("global", 1))
    ours = step_batches(examples, train.micro_batch_size, pad, rt.device, by_length=True, packed=packed)
    with FlopCounterMode(display=False) as counted:
        for batch in ours:
            with rt.adapted.context.uniform(("global",), [1.0], trainable=("global",)):
                out = lm_forward(rt.model, batch)
                assert out.loss is not None
                out.loss.backward()
    assert counted.get_total_flops() == flops.step_flops(shape, ours, train.lora, "labelled")["linear"]

    plain_model = plain_peft.peft_model(plain_peft.as_transformers_loads_it(tiny_llama()), train)
    plain = [collate(examples[s:s + 2], pad_id=pad) for s in range(0, len(examples), 2)]
    with FlopCounterMode(display=False) as counted:
        for batch in plain:
            plain_model(**batch).loss.backward()
    assert counted.get_total_flops() == flops.step_flops(shape, plain, train.lora, "all")["linear"]
    # the head on every position costs the plain loop more than the padding alone
    assert flops.step_flops(shape, plain, train.lora, "all")["linear"] > flops.step_flops(
        shape, plain, train.lora, "labelled")["linear"]
