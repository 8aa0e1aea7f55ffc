"""Packed training rows: the loss, the gradients and the states of a micro-batch's examples packed end to end
equal the same examples padded (transformers' own forward with ``labels``), float32, several shapes; the
trainer's packed step equals its plain step."""

from __future__ import annotations

import pytest
import torch

from adapters import LoraConfig
from models import tiny_llama

# the labelled-forward tests' examples and runtime (tiny Llama, 4 query heads over 2 key/value heads: the
# grouped-query path; every adapter with a non-zero B)
from tests.training.local.test_lm_forward import _examples, _runtime
from training.data import IGNORE, DataError, Example, collate
from training.local import packing
from training.local import train as local_train
from training.local.lm_forward import LMOutput, lm_forward
from training.local.micro_batches import packs, step_batches
from training.local.runtime import Runtime, TrainConfig
from training.local.train import lm_loss, train_adapters

SHAPES = [([9], [4]), ([5, 12, 7], [2, 9, 6]), ([16, 16], [1, 3]), ([3, 20, 11, 1, 4], [2, 15, 0, 0, 3])]


def _run(rt: Runtime, batch: dict, names: tuple[str, ...], trainable: tuple[str, ...],
         reference: bool) -> tuple[LMOutput, list[torch.Tensor]]:
    """The loss and states of ``batch`` with ``names`` on at equal weights, and the gradients of ``trainable``."""
    rt.adapted.set_trainable(list(trainable))
    params = rt.adapted.parameters_of(list(trainable))
    with rt.adapted.context.uniform(names, [1.0 / len(names)] * len(names), trainable=trainable):
        if reference:  # transformers' own forward: logits and float32 softmax at every padded position
            hf = rt.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=batch["labels"], output_hidden_states=True)
            out = LMOutput(hf.loss, hf.hidden_states[-1])
        else:
            out = lm_forward(rt.model, batch)
    assert out.loss is not None
    grads = torch.autograd.grad(out.loss, params)
    return out, list(grads)


def test_a_pack_restarts_positions_and_shifts_targets_inside_each_example() -> None:
    exs = _examples([3, 5, 2], [1, 2, 0])
    batch = packing.pack(exs)
    assert batch["input_ids"].tolist() == [[t for e in exs for t in e.input_ids]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    # each example's last token predicts nothing (not the next example's first token)
    expect = [*exs[0].labels[1:], IGNORE, *exs[1].labels[1:], IGNORE, *exs[2].labels[1:], IGNORE]
    assert batch["targets"].tolist() == [expect]
    p = batch[packing.PACK_KEY]
    assert p.rows == packing.batch_rows(batch) == 3
    assert p.gather.tolist() == [[0, 1, 2, 10, 10], [3, 4, 5, 6, 7], [8, 9, 10, 10, 10]]
    # scatter then gather is the identity on the packed positions
    assert p.gather.reshape(-1)[p.scatter].tolist() == list(range(10))


@pytest.mark.parametrize("lengths,prompt", SHAPES)
@pytest.mark.parametrize("names,trainable", [(("global",), ("global",)), (("global", "local"), ("local",))])
def test_a_packed_row_equals_its_examples_padded(lengths: list[int], prompt: list[int], names: tuple[str, ...],
                                                 trainable: tuple[str, ...]) -> None:
    rt = _runtime()
    exs = _examples(lengths, prompt)
    padded = collate(exs, pad_id=rt.tokenizer.pad_token_id)
    ref, ref_grads = _run(rt, padded, names, trainable, reference=True)
    packed = packing.pack(exs)
    got, grads = _run(rt, packed, names, trainable, reference=False)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 0 for g in ref_grads)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the packed states are the padded rows' real positions, in order
    real = ref.hidden[padded["attention_mask"].bool()]  # (N, H)
    assert got.hidden.shape == (1, sum(lengths), real.shape[-1])
    torch.testing.assert_close(got.hidden[0], real, rtol=1e-5, atol=1e-5)
    # one row per example again, as the feature terms (FedOA, FedMCP) read them
    states, mask = packing.padded_states(got.hidden, packed)
    assert torch.equal(mask, padded["attention_mask"])
    torch.testing.assert_close(states[mask.bool()], real, rtol=1e-5, atol=1e-5)
    assert not states[~mask.bool()].any()
    assert packing.padded_states(ref.hidden, padded)[0] is ref.hidden


def test_the_model_attends_as_before_once_a_packed_forward_ends_even_by_an_error() -> None:
    rt = _runtime()
    before = rt.model.config._attn_implementation
    batch = packing.pack(_examples([4, 6], [1, 2]))
    batch["position_ids"] = batch["position_ids"][:, :3]  # a shape the rotary embedding refuses
    with pytest.raises(RuntimeError):
        lm_forward(rt.model, batch)
    assert rt.model.config._attn_implementation == before
    lm_forward(rt.model, packing.pack(_examples([4, 6], [1, 2])))
    assert rt.model.config._attn_implementation == before


def test_packing_is_refused_by_name_where_the_model_cannot_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime()
    with pytest.raises(DataError, match="empty"):
        packing.pack([])
    with pytest.raises(DataError, match="no tokens"):
        packing.pack([Example((), ())])
    with pytest.raises(DataError, match="labels and input_ids differ"):
        packing.pack([Example((5, 6, 7), (IGNORE, 6))])
    rt.model.config.sliding_window = 4  # attention limited to a window: the packed attention does not honour it
    assert not packing.packable(rt.model)
    assert not packs(torch.device("cpu"), rt.model)
    with pytest.raises(ValueError, match="Llama-layout model without a sliding window"):
        lm_forward(rt.model, packing.pack(_examples([4], [1])))
    rt.model.config.sliding_window = None
    assert packs(torch.device("cpu"), rt.model)
    assert not packs(torch.device("cuda"), rt.model)  # not measured on an accelerator: the padded plan there
    monkeypatch.setattr(packing, "PLAIN_HEAD", frozenset())
    assert not packing.packable(rt.model)


def test_the_trainer_packs_the_plain_split_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    exs = _examples([31, 6, 17, 5, 40, 9, 12, 33], [15, 3, 8, 2, 20, 4, 6, 16])
    packed = step_batches(exs, 3, pad_id=2, device=torch.device("cpu"), by_length=True, packed=True)
    assert [packing.batch_rows(b) for b in packed] == [3, 3, 2]
    assert [b["input_ids"].numel() for b in packed] == [54, 54, 45]  # no padding: the plain split's real tokens
    seen: list[bool] = []
    real = local_train.step_batches

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kwargs["packed"])
        return real(*args, **kwargs)

    monkeypatch.setattr(local_train, "step_batches", spy)
    rt = Runtime(tiny_llama(), TrainConfig(batch_size=4, micro_batch_size=2, max_steps=2, lora=LoraConfig(dropout=0.1)))
    rt.set("global", rt.fresh("global", 0))
    res = train_adapters(rt, exs, ["global"], ["global"], [1.0], seed=0, loss_fn=lm_loss)
    assert seen == [True, True] and res.steps == 2 and torch.isfinite(torch.tensor(res.loss))
