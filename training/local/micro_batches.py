"""An optimizer step's micro-batches, grouped by length so that a forward pads little, the step's loss unchanged.

The step's loss is defined by the plain split (docs/methods.md 2.3, the reference's HF Trainer with gradient
accumulation): the step's examples in draw order cut into micro-batches of ``micro_batch_size`` rows,
each micro-batch's mean token loss weighted by its share of the rows. Padding to the longest row of a
randomly drawn micro-batch wastes most of a forward when lengths spread (FedDPA dataset 1 mixes 20- and
300-token prompts), so the forwards run on other groups: the examples sorted by length and cut where
padding is least (:func:`plan_groups`). Each row carries the weight its tokens had in the plain split
(``loss_weight``, read by :func:`training.local.lm_forward.lm_forward`), so the step's loss and gradient are the
plain split's up to float summation order. LoRA dropout draws its masks per forward, so with dropout on
the masks fall on other tokens (the same distribution).

On the CPU a forward's fixed cost is worth tens of padded tokens (``CPU_FORWARD_TOKENS``), so a step runs as
more, smaller forwards only where they save more padding than that; on an accelerator a small batch's step
waits on the host, so the number of forwards stays the plain split's.

Better still on the CPU, where the model allows it (:func:`training.local.packing.packable`): the plain split's
micro-batches packed, each into one row without padding (:mod:`training.local.packing`). The forwards are the
plain split's, their GEMMs as large as a micro-batch's real tokens, and no padding is computed at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from training.data import IGNORE, Example, collate
from training.local.lm_forward import WEIGHT_KEY
from training.local.packing import pack, packable

# A forward's fixed cost on the CPU in padded-token equivalents: a split is made only where it saves more
# padding than this. Measured, not derived: a training forward and backward of a few rows costs a floor
# worth tens of tokens (small GEMMs run far below the CPU's rate), which ``bench/training/forward_cost.py`` fits on a
# machine, and where it times plans made with other values (bench/training/HISTORY.md).
CPU_FORWARD_TOKENS = 64


def plan_groups(lengths: Sequence[int], max_rows: int, groups: int | None, forward_cost: int = 0) -> list[list[int]]:
    """Cut ``lengths`` (sorted by length) into groups of at most ``max_rows`` with the least padded tokens.

    Args:
        lengths: each example's token count.
        max_rows: rows per group at most.
        groups: exactly this many groups (None: as many as pay, ``forward_cost`` each).
        forward_cost: a group's fixed cost in padded tokens (with ``groups`` None).

    Returns:
        Index lists into ``lengths``, each ascending by length, the groups from shortest to longest.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sl = [lengths[i] for i in order]
    n, inf = len(sl), float("inf")
    # cost[g][j]: the first j sorted examples in g groups (with groups None, row 1 holds any number of groups,
    # each charged forward_cost); a group (i, j] pads to sl[j - 1]
    layers = 1 if groups is None else groups
    cost = [[inf] * (n + 1) for _ in range(layers + 1)]
    cut = [[0] * (n + 1) for _ in range(layers + 1)]
    cost[0][0] = 0.0
    for g in range(1, layers + 1):
        prev = cost[1] if groups is None else cost[g - 1]
        if groups is None:
            prev[0] = 0.0
        for j in range(1, n + 1):
            for i in range(max(0, j - max_rows), j):
                c = prev[i] + (j - i) * sl[j - 1] + (forward_cost if groups is None else 0)
                if c < cost[g][j]:
                    cost[g][j], cut[g][j] = c, i
    if cost[layers][n] == inf:
        raise ValueError(f"cannot cut {n} examples into {groups} groups of at most {max_rows}")
    ends, j, g = [], n, layers
    while j > 0:
        ends.append(j)
        j = cut[g][j]
        g = g if groups is None else g - 1
    out, start = [], 0
    for end in reversed(ends):
        out.append(order[start:end])
        start = end
    return out


def forward_cost(device: torch.device) -> int | None:
    """A forward's fixed cost on ``device`` in padded tokens, or None: keep the plain split's number of forwards.

    The plan, and so where LoRA dropout's masks fall, depends on the device kind: a run on a GPU draws
    other masks than the CPU's anyway (another generator).
    """
    return CPU_FORWARD_TOKENS if device.type == "cpu" else None


def packs(device: torch.device, model: torch.nn.Module) -> bool:
    """Whether a length-grouped loss's steps run as packed micro-batches on ``device`` with ``model``.

    On the CPU, for a :func:`training.local.packing.packable` model (bench/training/HISTORY.md: faster than the
    length-grouped plan). Not on an accelerator: its small steps wait on the host, and packing's gathers
    add kernels to every layer (not yet measured there).
    """
    return device.type == "cpu" and packable(model)


def _targets(example: Example) -> int:
    """Labelled tokens the shifted loss counts: labels from position 1 on (position 0 predicts nothing)."""
    return sum(1 for label in example.labels[1:] if label != IGNORE)


def step_batches(examples: Sequence[Example], micro_batch_size: int, pad_id: int, device: torch.device,
                 by_length: bool, more_forwards: bool = True, packed: bool = False) -> list[dict[str, Any]]:
    """The collated micro-batches of one optimizer step over ``examples`` (in draw order).

    Args:
        examples: the step's examples.
        micro_batch_size: rows per forward of the plain split (which defines the loss).
        pad_id: the tokenizer's pad id.
        device: the model's device.
        by_length: regroup by length with ``loss_weight`` rows (the loss reads it); False: the plain split.
        more_forwards: on the CPU, allow more forwards than the plain split where they pad less (False for
            a :class:`training.local.train.BatchLoss`, whose extra feature forwards grow with their number).
        packed: the plain split's micro-batches, each packed into one row (:func:`training.local.packing.pack`;
            the loss reads it through :func:`training.local.lm_forward.lm_forward`); ``by_length`` is then moot.

    Returns:
        Collated or packed batches; the trainer weights each one's loss by its share of the step's rows
        (:func:`training.local.packing.batch_rows`).
    """
    n = len(examples)
    plain = [list(range(s, min(n, s + micro_batch_size))) for s in range(0, n, micro_batch_size)]
    if packed:
        return [pack([examples[i] for i in micro], device=device) for micro in plain]
    if by_length and n > 1:
        cost = forward_cost(device) if more_forwards else None
        groups = plan_groups([len(e.input_ids) for e in examples], micro_batch_size,
                             len(plain) if cost is None else None, cost or 0)
    else:
        groups = plain
    if {frozenset(g) for g in groups} == {frozenset(m) for m in plain}:
        return [collate([examples[i] for i in g], pad_id=pad_id, device=device) for g in plain]
    # token weight of example i in the plain split: (rows of its micro-batch / n) / (its labelled tokens);
    # a group's loss is multiplied by rows_g / n by the trainer, so the row weight carries n / rows_g
    share: dict[int, float] = {}
    for micro in plain:
        tokens = sum(_targets(examples[i]) for i in micro)
        for i in micro:
            share[i] = len(micro) / tokens if tokens else float("nan")  # HF's mean over no token: nan too
    out = []
    for g in groups:
        batch = collate([examples[i] for i in g], pad_id=pad_id, device=device)
        batch[WEIGHT_KEY] = torch.tensor([share[i] / len(g) for i in g], dtype=torch.float32, device="cpu").to(device)
        out.append(batch)
    return out
