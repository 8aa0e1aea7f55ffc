"""The training forward: the decoder on every position, the LM head and the loss on labelled positions only.

The loss is the causal-LM loss of transformers' ``ForCausalLM`` models (labels shifted by one, ignore
index -100, float32 cross-entropy, the mean over the micro-batch's labelled tokens; docs/methods.md 2.3 trains
on response tokens only, ``train_on_inputs=False``). Transformers computes it from the head's logits
over every position; only the response positions carry a label, and FedDPA's prompts are most of each
example, so here the final-layer states are gathered at the labelled positions first and the head
(576 x 49,152 for SmolLM2) and the softmax run on those rows alone. The value and the gradients are the
full forward's up to float summation order (tests/training/local/test_lm_forward.py).

A batch may carry ``loss_weight`` (B,): the loss is then ``sum_t w[row(t)] * CE_t`` over the labelled
tokens instead of their mean, which lets the trainer regroup a step's examples by length and keep every
token's weight (:mod:`training.local.train`). A packed batch (:mod:`training.local.packing`: a micro-batch's
examples end to end in one row, no padding) gives the mean over its labelled tokens, as the same examples
padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from training.data import IGNORE
from training.local.packing import PACK_KEY, PLAIN_HEAD, PlainHeadLM, packable, packed_states, plain_head

WEIGHT_KEY = "loss_weight"


@dataclass(frozen=True)
class LMOutput:
    """What a training forward gives.

    Attributes:
        loss: the LM loss (a float32 scalar), or None when it was not asked for.
        hidden: (B, T, H) final-layer states, HF's ``hidden_states[-1]`` (after the final norm).
    """

    loss: torch.Tensor | None
    hidden: torch.Tensor


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts label t + 1, the last position nothing (-100)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)


def label_loss(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
               weight: torch.Tensor | None) -> torch.Tensor:
    """The loss over labelled rows: their mean CE, or ``sum w[row] * CE`` when a row weight is given.

    Args:
        logits: (N, V) the head's output at the N labelled positions.
        targets: (N,) their target ids.
        rows: (N,) the batch row of each position.
        weight: (B,) per-row token weight, or None for the mean.
    """
    logits = logits.float()  # as transformers: the softmax in float32 whatever the compute dtype
    if weight is None:
        return torch.nn.functional.cross_entropy(logits, targets)
    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # (N,)
    return (ce * weight.to(ce.device, torch.float32)[rows]).sum()


def lm_forward(model: torch.nn.Module, batch: dict[str, Any], with_loss: bool = True) -> LMOutput:
    """Run ``model`` on a collated or packed batch: final-layer states, and the LM loss on the labelled positions.

    Args:
        model: an HF causal LM (adapters, if any, set on their context by the caller).
        batch: ``input_ids``, ``attention_mask`` (B, T); ``labels`` (B, T) when ``with_loss``; optional
            ``loss_weight`` (B,). Or a packed row (:func:`training.local.packing.pack`, a :func:`packable` model):
            ``input_ids``, ``position_ids``, ``targets`` (1, N) and its ``pack``.
        with_loss: compute the loss (False: the states only, the head never runs on the plain path).

    Returns:
        The loss (None without ``with_loss``) and the (B, T, H) final-layer states ((1, N, H) packed).
    """
    if PACK_KEY in batch:
        return _packed(model, batch, with_loss)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    weight = batch.get(WEIGHT_KEY)
    if not plain_head(model):
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        hidden, logits = out.hidden_states[-1], out.logits  # (B, T, H), (B, T, V)
    else:
        lm = cast(PlainHeadLM, model)  # plain_head checked these members
        hidden = lm.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        logits = None
    if not with_loss:
        return LMOutput(None, hidden)
    targets = shifted_targets(batch["labels"]).reshape(-1)  # (B*T,)
    flat = (targets != IGNORE).nonzero().squeeze(1)  # (N,) labelled positions, row-major
    rows = flat // ids.shape[1]
    if logits is None:  # plain_head(model): lm above
        logits = lm.lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat))  # (N, V)
    else:
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat)
    return LMOutput(label_loss(logits, targets.index_select(0, flat), rows, weight), hidden)


def _packed(model: torch.nn.Module, batch: dict[str, Any], with_loss: bool) -> LMOutput:
    """A packed row's forward: the mean loss over its labelled tokens, as its examples' padded micro-batch's."""
    if not packable(model):
        raise ValueError(f"a packed batch needs a Llama-layout model without a sliding window "
                         f"({sorted(PLAIN_HEAD)}), got "
                         f"{getattr(getattr(model, 'config', None), 'model_type', None) or type(model).__name__}")
    hidden = packed_states(model, batch)  # (1, N, H)
    if not with_loss:
        return LMOutput(None, hidden)
    targets = batch["targets"].reshape(-1)  # (N,) shifted inside each example
    flat = (targets != IGNORE).nonzero().squeeze(1)  # (L,) labelled positions
    logits = cast(PlainHeadLM, model).lm_head(hidden[0].index_select(0, flat))  # (L, V): packable checked it
    # the plain mean over the row's labelled tokens (no row weights, so the rows argument goes unread)
    return LMOutput(label_loss(logits, targets.index_select(0, flat), flat, None), hidden)
