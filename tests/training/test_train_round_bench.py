"""``bench/train_round.py`` counts the work each loop trains on exactly: its replay of a local run's shuffle and
micro-batches gives the real and padded tokens the trainer's forwards actually see."""

from __future__ import annotations

import torch

from adapters import LoraConfig
from models import LoadedModel
from tests.bench_script import load_bench
from training.data import Example, collate, generate_suite
from training.local_train import length_grouped, lm_loss, train_adapters
from training.protocol import derive_seed
from training.runtime import Runtime, TrainConfig


def _bench():  # noqa: ANN202 - the script is not a package module
    return load_bench("train_round")


def _spread(examples: list[Example]) -> list[Example]:
    """The examples with lengths spread 1x-6x, so length grouping changes the micro-batches."""
    out = []
    for k, e in enumerate(examples):
        times = 1 + k % 6
        out.append(Example(e.input_ids * times, e.labels * times))
    return out


def test_drawn_work_is_what_the_trainer_forwards(tiny: LoadedModel) -> None:
    bench = _bench()
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
    pad = rt.tokenizer.pad_token_id
    tokens, padded = bench.drawn_work(examples, train, seed, pad, rt.device)
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
    assert bench.drawn_work(examples, train, seed, pad, rt.device, by_length=False) == (tokens, plain_padded)
    assert plain_padded > padded  # grouping by length pads less on this spread
