"""Choose a run's learning rate on a validation split of the clients' training data (``--lr-search``).

A budget's learning rate is a rule's (:mod:`training.local.regime`: the paper's lr times ``sqrt`` of the step
ratio, capped), not a tuned value. This search scores a small grid of multiples of it and keeps the best,
per method and budget, without looking at any test set:

* a few clients (seeded draw) each hold out ``share`` of their *training* examples (the same seeded
  split as ``--hold-out``, :func:`training.data.partition.hold_out`) as validation;
* for every candidate rate, a fresh LoRA adapter trains on the rest of the client's examples with the
  run's optimizer, schedule, batch, steps per local run and per-round decay, for the run's rounds (one
  local trajectory, no aggregation: the proxy is the method's local training with the plain LM loss, so
  its own extra terms and routing are left out);
* the score is the mean response-token loss on the validation examples, averaged over the clients; the
  lowest wins (ties: the smaller rate).

The cost is ``len(grid) * clients * rounds`` local runs (3 x 2 x the run's rounds by default: about as much
as two clients' share of the run itself). run.json records the grid, the scores and the choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from models import LoadedModel
from training.data import IGNORE, ClientData, Example, FederatedDataset, collate
from training.data.partition import hold_out
from training.local.lm_forward import lm_forward, shifted_targets
from training.local.runtime import Runtime, TrainConfig
from training.local.train import train_adapters
from training.state import derive_seed

GRID = (0.5, 1.0, 2.0)  # multiples of the rule's rate: one halving and one doubling around it


@dataclass(frozen=True)
class LrSearch:
    """A search's outcome (what run.json records under ``lr_search``).

    Attributes:
        lrs: the candidate rates.
        val_loss: the mean validation loss of each (after training), in ``lrs`` order.
        start_loss: the validation loss before training (the fresh adapter: B = 0, the base model).
        lr: the chosen rate.
        clients: the clients scored.
        share: the share of each client's training examples held out.
    """

    lrs: tuple[float, ...]
    val_loss: tuple[float, ...]
    start_loss: float
    lr: float
    clients: tuple[str, ...]
    share: float

    def asdict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {"lrs": list(self.lrs), "val_loss": list(self.val_loss), "start_loss": self.start_loss, "lr": self.lr,
                "clients": list(self.clients), "share": self.share, "grid": list(GRID)}


@torch.no_grad()
def validation_loss(rt: Runtime, examples: Sequence[Example], names: Sequence[str] = ("global",)) -> float:
    """Mean response-token loss of ``examples`` with adapters ``names`` on at weight 1 (eval mode)."""
    rt.model.eval()
    total, tokens = 0.0, 0
    batch_size = rt.train.micro_batch_size
    for start in range(0, len(examples), batch_size):
        batch = collate(list(examples[start:start + batch_size]), pad_id=rt.tokenizer.pad_token_id, device=rt.device)
        count = int((shifted_targets(batch["labels"]) != IGNORE).sum())
        if count == 0:  # no response token within the cutoff: nothing to score
            continue
        with rt.adapted.context.uniform(tuple(names), [1.0] * len(names), trainable=()), rt.loaded.autocast():
            mean = lm_forward(rt.model, batch).loss  # the batch's mean over its labelled tokens
        assert mean is not None
        total += float(mean) * count
        tokens += count
    return total / max(1, tokens)


def _trajectory(rt: Runtime, train: list[Example], val: list[Example], rounds: int, seed: int) -> float:
    """Train a fresh ``global`` adapter for ``rounds`` local runs; its validation loss."""
    rt.fresh("global", seed)
    for r in range(rounds):
        train_adapters(rt, train, ["global"], ["global"], [1.0], seed=derive_seed(seed, r), desc=f"lr-search r{r}",
                       round_idx=r)
    return validation_loss(rt, val)


def search_lr(loaded: LoadedModel, dataset: FederatedDataset, train: TrainConfig, rounds: int,
              grid: Sequence[float] = GRID, clients: int = 2, share: float = 0.2, seed: int = 0) -> LrSearch:
    """Score ``train.lr * m`` for ``m`` in ``grid`` on validation splits of ``clients`` clients' training data.

    Args:
        loaded: the base model (adapters are injected for the search and removed after it).
        dataset: the run's data set; only training examples are read.
        train: the run's settings (its ``lr`` is the rule's, the centre of the grid).
        rounds: local runs per trajectory (the run's rounds).
        grid: multiples of ``train.lr`` to try.
        clients: how many clients to score (a seeded draw; all if fewer).
        share: the share of each scored client's examples held out, in (0, 0.5].
        seed: the draw, the split and the training seed.

    Raises:
        ValueError: an empty grid, a non-positive multiple or ``clients`` < 1.
    """
    if not grid or any(not m > 0 for m in grid) or clients < 1:
        raise ValueError(f"lr search needs positive multiples and clients >= 1, got {list(grid)}, {clients}")
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, "lr-search"))
    order = torch.randperm(len(dataset.clients), generator=gen).tolist()[:clients]
    picked: tuple[ClientData, ...] = tuple(dataset.clients[i] for i in sorted(order))
    split = hold_out(FederatedDataset(dataset.name, picked, dataset.tests), share, seed=seed)
    lrs = tuple(train.lr * m for m in grid)
    scores = [0.0] * len(lrs)
    start = 0.0
    rt = Runtime(loaded, train)
    try:
        for c in split.clients:
            held = ClientData(f"{c.client_id}-validation", c.task, c.validation)
            tr, val = rt.examples(c), rt.examples(held)
            rt.fresh("global", seed)
            start += validation_loss(rt, val) / len(split.clients)
            for i, lr in enumerate(lrs):
                rt.train = replace(train, lr=lr)
                scores[i] += _trajectory(rt, tr, val, rounds, derive_seed(seed, c.client_id)) / len(split.clients)
    finally:
        rt.adapted.remove()
    best = min(range(len(lrs)), key=lambda i: (scores[i] if math.isfinite(scores[i]) else math.inf, lrs[i]))
    return LrSearch(lrs, tuple(scores), start, lrs[best], tuple(c.client_id for c in picked), share)
