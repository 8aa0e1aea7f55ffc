"""Length-grouped micro-batches: the least padding, and an optimizer step equal to the plain split's."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from adapters import LoraConfig
from models import tiny_llama
from training.algorithms.fedmcp import FedMCPLoss
from training.algorithms.fedoa import FedOALoss
from training.data import IGNORE, Example
from training.local import train as local_train
from training.local.lm_forward import WEIGHT_KEY
from training.local.micro_batches import plan_groups, step_batches
from training.local.runtime import Runtime, TrainConfig
from training.local.train import lm_loss, train_adapters

LENGTHS = [31, 6, 17, 5, 40, 9, 12, 33]


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]
        yield [[first], *part]


def _padded(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


@pytest.mark.parametrize("lengths,max_rows", [([7, 3, 9, 1, 4, 8], 2), ([5, 5, 20, 6, 19, 2], 3), ([4, 9, 2], 3)])
def test_plan_is_the_least_padding_of_every_partition(lengths: list[int], max_rows: int) -> None:
    parts = [p for p in _partitions(list(range(len(lengths)))) if all(len(g) <= max_rows for g in p)]
    fixed = -(-len(lengths) // max_rows)
    for groups, cost in ((fixed, 0), (None, 0), (None, 6)):
        plan = plan_groups(lengths, max_rows, groups, cost)
        assert sorted(i for g in plan for i in g) == list(range(len(lengths)))
        assert all(1 <= len(g) <= max_rows for g in plan)
        allowed = [p for p in parts if groups is None or len(p) == groups]
        best = min(_padded(lengths, p) + cost * len(p) for p in allowed)
        assert _padded(lengths, plan) + cost * len(plan) == best
        if groups is not None:
            assert len(plan) == groups


def _examples() -> list[Example]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, 500, (n,), generator=gen).tolist()
        p = n // 2
        out.append(Example(tuple(ids), tuple([IGNORE] * p + ids[p:])))
    return out


def test_grouped_batches_pad_less_and_carry_the_plain_weights() -> None:
    exs = _examples()
    plain = step_batches(exs, 4, pad_id=2, device=torch.device("cpu"), by_length=False)
    for more in (True, False):
        grouped = step_batches(exs, 4, pad_id=2, device=torch.device("cpu"), by_length=True, more_forwards=more)
        assert sum(b["input_ids"].numel() for b in grouped) < sum(b["input_ids"].numel() for b in plain)
        assert all(WEIGHT_KEY in b for b in grouped)
        if not more:
            assert len(grouped) == len(plain)
        # every token keeps its plain weight: the rows' weights times the group's row share sum to one per
        # plain micro-batch's tokens
        total = sum(float((b[WEIGHT_KEY] * ((b["labels"][:, 1:] != IGNORE).sum(dim=1))).sum()) * len(b["input_ids"])
                    / len(exs) for b in grouped)
        assert total == pytest.approx(1.0)


class _PlainFedMCP(FedMCPLoss):
    length_grouped = False


class _PlainFedOA(FedOALoss):
    length_grouped = False


def _step(loss, micro: int) -> tuple[torch.Tensor, float]:  # noqa: ANN001
    """The adapters' change after one SGD step over all 8 examples, and the step's loss."""
    rt = Runtime(tiny_llama(), TrainConfig(optimizer="sgd", lr=1.0, schedule="constant", batch_size=len(LENGTHS),
                                           micro_batch_size=micro, max_steps=1, lora=LoraConfig(dropout=0.0)))
    gen = torch.Generator().manual_seed(5)
    for i, name in enumerate(("global", "local", "received")):
        state = rt.fresh(name, i)
        rt.set(name, {k: torch.randn(v.shape, generator=gen) * 0.3 if k.endswith("lora_B") else v
                      for k, v in state.items()})
    trainable = ["global", "local"] if isinstance(loss, FedMCPLoss) else ["local"] if isinstance(
        loss, FedOALoss) else ["global"]
    weights = [0.5, 0.5] if isinstance(loss, FedMCPLoss) else [1.0]
    before = torch.cat([p.detach().flatten().clone() for p in rt.adapted.parameters_of(trainable)])
    res = train_adapters(rt, _examples(), trainable, trainable, weights, seed=0, loss_fn=loss)
    after = torch.cat([p.detach().flatten() for p in rt.adapted.parameters_of(trainable)])
    return after - before, res.loss


def _plain_lm(rt, batch, names, weights):  # noqa: ANN001, ANN202
    return lm_loss(rt, batch, names, weights)  # the same loss, not marked length_grouped: the plain split


@pytest.mark.parametrize("micro", [3, 8])
@pytest.mark.parametrize("packed", [True, False])
def test_a_grouped_step_equals_the_plain_step(micro: int, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # on the CPU a length-grouped loss's step runs packed (training.local.packing); else as length-grouped batches
    monkeypatch.setattr(local_train, "packs", lambda device, model: packed)
    grouped, plain = _step(lm_loss, micro), _step(_plain_lm, micro)
    assert grouped[0].abs().max() > 1e-3
    torch.testing.assert_close(grouped[0], plain[0], rtol=1e-4, atol=1e-6)
    assert grouped[1] == pytest.approx(plain[1], rel=1e-5)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("method", ["fedmcp", "fedoa"])
def test_a_grouped_batch_loss_step_equals_the_plain_step(method: str, packed: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the whole-batch terms read per-example features: pooled from packed rows, or from grouped batches
    monkeypatch.setattr(local_train, "packs", lambda device, model: packed)
    ours, theirs = (FedMCPLoss(0.5, 5.0), _PlainFedMCP(0.5, 5.0)) if method == "fedmcp" else (
        FedOALoss(0.5, "l2"), _PlainFedOA(0.5, "l2"))
    grouped, plain = _step(ours, 3), _step(theirs, 3)
    assert grouped[0].abs().max() > 1e-3
    torch.testing.assert_close(grouped[0], plain[0], rtol=1e-4, atol=1e-6)
    assert grouped[1] == pytest.approx(plain[1], rel=1e-5)


def test_groups_are_tried_in_every_order() -> None:
    # the plan does not depend on the order the step drew its examples in (only on their lengths)
    for perm in itertools.islice(itertools.permutations(range(5)), 0, 120, 17):
        lengths = [[4, 9, 2, 7, 7][i] for i in perm]
        plan = plan_groups(lengths, 2, 3)
        assert sorted(_padded(lengths, [g]) for g in plan) == [8, 9, 14]  # (2, 4) (9) (7, 7)


def test_the_cpu_splits_a_step_only_where_the_padding_saved_pays_for_a_forward() -> None:
    # one 30-token row among three of 10: splitting it off saves 60 padded tokens, less than a CPU forward's
    # fixed cost (bench/training/forward_cost.py: about 75 tokens for SmolLM2 on 2 cores), so the step stays one forward
    gen = torch.Generator().manual_seed(3)
    exs = []
    for n in (10, 30, 10, 10):
        ids = torch.randint(3, 500, (n,), generator=gen).tolist()
        exs.append(Example(tuple(ids), tuple([IGNORE] * (n // 2) + ids[n // 2:])))
    assert len(step_batches(exs, 4, pad_id=2, device=torch.device("cpu"), by_length=True)) == 1
    # a 90-token row among them saves 240: worth its own forward
    long = torch.randint(3, 500, (90,), generator=gen).tolist()
    exs[1] = Example(tuple(long), tuple([IGNORE] * 45 + long[45:]))
    assert [len(b["input_ids"]) for b in step_batches(exs, 4, pad_id=2, device=torch.device("cpu"),
                                                      by_length=True)] == [3, 1]
