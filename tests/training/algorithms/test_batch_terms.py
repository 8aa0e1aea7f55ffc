"""Whole-batch loss terms (FedOA's distance, FedMCP's CKA): one optimizer step is the same for every
micro-batch size, and the split matches autograd on the whole batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from adapters import LoraConfig
from models import tiny_llama
from training.algorithms.fedmcp import fedmcp_loss
from training.algorithms.fedoa import fedoa_loss
from training.algorithms.terms.batch_terms import micro_share, split_term
from training.data import generate_suite
from training.local.runtime import Runtime, TrainConfig
from training.local.train import train_adapters

DATA = generate_suite(n_train=4, n_test=1, families=["sorting"]).clients[0]
TRAIN = TrainConfig(optimizer="sgd", lr=0.5, schedule="constant", batch_size=4, micro_batch_size=4, max_steps=1,
                    cutoff_len=64, lora=LoraConfig(dropout=0.0), max_grad_norm=None)  # SGD's move: -lr * gradient


def _state(rt: Runtime, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = rt.fresh("global", seed)
    return {k: (torch.randn(v.shape, generator=gen) * 0.2 if k.endswith("lora_B") else v) for k, v in base.items()}


def _step(method: str, micro: int, strength: float) -> tuple[torch.Tensor, float]:
    """Adapters' change after one SGD step on the 4 examples, and the step's loss."""
    rt = Runtime(tiny_llama(), replace(TRAIN, micro_batch_size=micro))
    glob, local = _state(rt, 1), _state(rt, 2)
    rt.set("global", glob)
    rt.set("received", _state(rt, 3))
    rt.set("local", local)
    if method == "fedoa":
        trainable, names, weights, loss = ["local"], ["local"], [1.0], fedoa_loss(strength, "l2")
    else:
        trainable, names, weights = ["global", "local"], ["global", "local"], [0.5, 0.5]
        loss = fedmcp_loss(0.5, strength)
    before = torch.cat([p.detach().flatten().clone() for p in rt.adapted.parameters_of(trainable)])
    res = train_adapters(rt, rt.examples(DATA), trainable, names, weights, seed=0, loss_fn=loss)
    after = torch.cat([p.detach().flatten() for p in rt.adapted.parameters_of(trainable)])
    return after - before, res.loss


@pytest.mark.parametrize("method,strength", [("fedoa", 0.5), ("fedmcp", 5.0)])
def test_one_step_does_not_depend_on_the_micro_batch_size(method: str, strength: float) -> None:
    # SGD moves by -lr * gradient, so the term's own move is the step with it minus the step without it (the
    # LM loss is a per-micro-batch token mean weighted by rows, as in HF's Trainer: not part of this claim).
    moves = {}
    for micro in (4, 2, 1):
        with_term, _ = _step(method, micro, strength)
        without, _ = _step(method, micro, 0.0)
        moves[micro] = with_term - without
    assert moves[4].abs().max() > 1e-5  # the term moves the adapters: the comparison below means something
    # A move is a difference of fp32 parameters of magnitude up to ~4, so its rounding is a few 1e-7
    # whatever its size; a term that depended on the split would differ by about the move itself.
    for micro in (2, 1):
        torch.testing.assert_close(moves[micro], moves[4], rtol=1e-3, atol=2e-6)


def test_split_shares_sum_to_the_whole_batch_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    z = torch.randn(6, 3, generator=gen, dtype=torch.float64)

    def term(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.dist(a, c) + (a.sum(0) ** 2).sum()  # neither term decomposes over rows

    leaf = x.clone().requires_grad_(True)
    want = term(leaf, z)
    (want_grad,) = torch.autograd.grad(want, leaf)
    sizes = (1, 2, 3)
    parts, consts = list(x.split(sizes)), list(z.split(sizes))
    split = split_term(term, [(p,) for p in parts], [(c,) for c in consts])
    total, grads = torch.zeros((), dtype=torch.float64), []
    for m, p in enumerate(parts):
        leaf_m = p.clone().float().requires_grad_(True)
        share = micro_share(split, m, (leaf_m,)) * (len(p) / 6)  # weighted as the trainer weights it
        (g,) = torch.autograd.grad(share, leaf_m)
        total += share.detach().double()
        grads.append(g.double())
    assert float(total) == pytest.approx(float(want.detach()), rel=1e-5)
    torch.testing.assert_close(torch.cat(grads), want_grad, rtol=1e-4, atol=1e-6)
