"""Loss terms over the whole logical batch, trained through micro-batches with gradient accumulation.

FedOA's feature distance (the Frobenius norm of the whole batch's feature difference, paper 001) and
FedMCP's linear CKA (paper 004) do not decompose over micro-batches: computed per micro-batch, their
strength would change with ``--micro-batch-size``. :func:`split_term` evaluates such a term once per
optimizer step on every micro-batch's features (computed without gradients, model in eval mode so the
features do not depend on dropout draws) and returns its value and its gradient with respect to each
micro-batch's features. Each micro-batch then adds :func:`micro_share`: a term whose gradient with
respect to its features (recomputed with gradients) is exactly that slice of the whole-batch gradient
and whose values sum to the whole-batch value. With LoRA dropout off, one optimizer step is the same for
every micro-batch size (tested); with dropout on, the gradient is taken at the dropout-free features.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch


@dataclass(frozen=True)
class SplitTerm:
    """A whole-batch term's value and its gradients per micro-batch.

    Attributes:
        value: the term's value over the whole batch (a detached scalar).
        grads: ``grads[m][k]``: d value / d (feature k of micro-batch m), shaped like that feature.
        rows: the whole batch's row count.
    """

    value: torch.Tensor
    grads: list[tuple[torch.Tensor, ...]]
    rows: int


def split_term(term: Callable[..., torch.Tensor], features: Sequence[Sequence[torch.Tensor]],
               constants: Sequence[Sequence[torch.Tensor]] = ()) -> SplitTerm:
    """Evaluate ``term`` on the whole batch and split its gradient over the micro-batches.

    Args:
        term: ``term(F_1, ..., F_K, C_1, ..., C_J) -> scalar`` on whole-batch tensors (rows concatenated, fp32).
        features: ``features[m][k]``: feature k of micro-batch m, (rows_m, ...), no gradients needed.
        constants: ``constants[m][j]``: tensors the term reads but never differentiates (FedOA's global
            features, FedMCP's received-global ones); empty or one entry per micro-batch.
    """
    sizes = [int(f[0].shape[0]) for f in features]
    count = len(features[0])
    leaves = [torch.cat([f[k].detach().float() for f in features]).requires_grad_(True) for k in range(count)]
    fixed = [torch.cat([c[j].detach().float() for c in constants]) for j in range(len(constants[0]))] if constants \
        else []
    with torch.enable_grad():
        value = term(*leaves, *fixed)
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
    split = [torch.zeros_like(leaf).split(sizes) if g is None else g.split(sizes) for leaf, g in zip(leaves, grads,
                                                                                                     strict=True)]
    return SplitTerm(value.detach(), [tuple(s[m] for s in split) for m in range(len(sizes))], sum(sizes))


def micro_share(split: SplitTerm, index: int, features: Sequence[torch.Tensor]) -> torch.Tensor:
    """Micro-batch ``index``'s share of the term, *per example* (the trainer weights it by rows_m / rows).

    Its gradient with respect to ``features`` (this micro-batch's, with gradients) is the whole-batch
    gradient's slice, and ``sum_m share_m * rows_m / rows`` is the whole-batch value.
    """
    rows_m = int(features[0].shape[0])
    # a tensor: features is not empty (features[0] above), so sum never returns its start 0
    lin = cast(torch.Tensor, sum((f.float() * g.to(f.device)).sum()
                                 for f, g in zip(features, split.grads[index], strict=True)))
    share = lin - lin.detach() + split.value.to(lin.device) * (rows_m / split.rows)
    return share * (split.rows / rows_m)


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """No dropout and no gradients for the features of :func:`split_term`; the model's mode restored after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)
