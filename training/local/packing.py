"""Padding-free training forwards: a micro-batch's examples packed into one row, each attending to itself.

A padded micro-batch computes every linear layer on ``rows x longest`` positions; FedDPA dataset 1 mixes
20- and 300-token examples, and the length-grouped split (:mod:`training.local.micro_batches`) buys less padding
with more, smaller forwards, which run the CPU's GEMMs below their rate. Packed, the examples of a
micro-batch of the plain split (docs/methods.md 2.3) sit end to end in a single row of ``N`` real tokens: the
linear layers (all but a few percent of the FLOPs) run once on ``N`` rows and never on padding, and the
step keeps the plain split's forwards and loss, each micro-batch's mean over its labelled tokens.

Only attention needs each example apart. :func:`packed_attention`, registered with transformers'
``AttentionInterface``, gathers the packed queries, keys and values into a right-padded ``(B, T)`` layout,
runs causal SDPA there (a real query never sees a later position, so never a pad) and scatters the
outputs back; position ids restart at every example, so the rotary embedding is the unpacked one.
The model's other code (norms, projections, MLP, adapters) is transformers' own, so the loss and the
gradients equal the padded forward's up to float summation order (tests/training/local/test_packing.py).
The targets are shifted inside each example: the last token of one example predicts nothing, not the
next example's first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from training.data import IGNORE, DataError, Example

ATTENTION = "fedmosaic_packed"
PACK_KEY = "pack"
# Model types whose ForCausalLM forward is ``lm_head(last_hidden_state)`` with nothing after it (no logit
# soft-capping or scaling), and whose decoder is transformers' Llama layout (rotary positions from
# ``position_ids``, the attention through ``AttentionInterface``): their head can run on gathered rows,
# and their decoder on packed ones.
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class Pack:
    """Where each example of a packed row lies, for attention (tensors only: a compiled layer traces its
    sizes symbolically instead of recompiling for every pack).

    Attributes:
        gather: (B, T) for each slot of the right-padded layout attention runs in (B examples, T the
            longest) its packed position, ``N`` (a zero row) on padding.
        scatter: (N,) for each packed position its slot in the flattened (B*T,) layout.
    """

    gather: torch.Tensor
    scatter: torch.Tensor

    @property
    def rows(self) -> int:
        """B, the examples packed."""
        return int(self.gather.shape[0])


class PlainHeadLM(Protocol):
    """The members :func:`plain_head` checks a causal LM has (``nn.Module``'s ``__getattr__`` types them loosely)."""

    config: PreTrainedConfig
    model: torch.nn.Module  # the decoder
    lm_head: torch.nn.Linear


def plain_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a causal LM of :data:`PLAIN_HEAD` whose head is a plain Linear on its decoder."""
    head = getattr(model, "lm_head", None)
    return (getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEAD
            and type(head) is torch.nn.Linear and hasattr(model, "model"))


def packable(model: torch.nn.Module) -> bool:
    """Whether ``model`` can take packed rows: :func:`plain_head`, and no sliding window to honour."""
    config = getattr(model, "config", None)
    return (plain_head(model) and not getattr(config, "use_sliding_window", False)
            and getattr(config, "sliding_window", None) is None)


def pack(examples: Sequence[Example], device: torch.device | str = "cpu") -> dict[str, Any]:
    """Pack ``examples`` end to end into one row (their order kept).

    Returns:
        ``input_ids`` and ``position_ids`` (1, N), ``targets`` (1, N) (each example's labels shifted by one
        inside it, -100 at its last token), ``attention_mask`` (1, N) ones, and ``pack``: a :class:`Pack`.
    """
    if not examples:
        raise DataError("cannot pack an empty batch")
    lengths = [len(e.input_ids) for e in examples]
    if min(lengths) < 1:
        raise DataError("cannot pack an example with no tokens")
    if any(len(e.labels) != n for e, n in zip(examples, lengths, strict=True)):
        raise DataError("cannot pack an example whose labels and input_ids differ in length")
    ids = [t for e in examples for t in e.input_ids]
    targets = [t for e in examples for t in (*e.labels[1:], IGNORE)]
    positions = [p for n in lengths for p in range(n)]
    width, total = max(lengths), len(ids)
    gather = torch.full((len(examples), width), total, dtype=torch.long)
    scatter: list[int] = []
    start = 0
    for row, n in enumerate(lengths):
        gather[row, :n] = torch.arange(start, start + n)
        scatter.extend(range(row * width, row * width + n))
        start += n
    row_tensors = {"input_ids": ids, "position_ids": positions, "targets": targets, "attention_mask": [1] * total}
    batch: dict[str, Any] = {k: torch.tensor([v], dtype=torch.long).to(device) for k, v in row_tensors.items()}
    batch[PACK_KEY] = Pack(gather.to(device), torch.tensor(scatter, dtype=torch.long).to(device))
    return batch


def batch_rows(batch: dict[str, Any]) -> int:
    """The examples a collated or packed batch holds."""
    p = batch.get(PACK_KEY)
    return p.rows if isinstance(p, Pack) else int(batch["input_ids"].shape[0])


def padded_states(hidden: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's final-layer states and the mask of their real tokens, one row per example.

    Args:
        hidden: (B, T, H) states of a collated batch, or (1, N, H) of a packed one.
        batch: the batch they came from.

    Returns:
        (B, T, H) states (a packed row's examples right-padded with zero states) and their (B, T) mask.
    """
    p = batch.get(PACK_KEY)
    if not isinstance(p, Pack):
        return hidden, batch["attention_mask"]
    total = hidden.shape[1]
    rows = torch.cat([hidden[0], hidden.new_zeros(1, hidden.shape[2])]).index_select(0, p.gather.reshape(-1))
    return rows.view(*p.gather.shape, hidden.shape[2]), (p.gather < total).long()


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     fedmosaic_pack: Pack | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of a packed row, each example on its own (transformers' attention-function signature).

    Without ``fedmosaic_pack`` (an unpacked batch) it is transformers' SDPA attention.

    Args:
        module: the attention module.
        query: (1, heads, N, d); key, value: (1, kv_heads, N, d).
        attention_mask: unused for a packed row (the layout is the mask).
        dropout: attention dropout probability.
        scaling: the softmax scale.
        fedmosaic_pack: where the examples lie.
        kwargs: transformers' other attention arguments.

    Returns:
        (1, N, heads, d) outputs, as transformers' attention functions give them, and no weights.
    """
    if fedmosaic_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    gather, scatter = fedmosaic_pack.gather, fedmosaic_pack.scatter
    rows, width = gather.shape

    def padded(x: torch.Tensor) -> torch.Tensor:  # (1, h, N, d) -> (B, h, T, d)
        h, d = x.shape[1], x.shape[3]
        slots = torch.cat([x[0], x.new_zeros(h, 1, d)], dim=1).index_select(1, gather.reshape(-1))  # (h, B*T, d)
        return slots.view(h, rows, width, d).transpose(0, 1)

    out = torch.nn.functional.scaled_dot_product_attention(
        padded(query), padded(key), padded(value), is_causal=True, scale=scaling,
        dropout_p=dropout if module.training else 0.0, enable_gqa=query.shape[1] != key.shape[1])  # (B, h, T, d)
    out = out.transpose(1, 2).reshape(rows * width, out.shape[1], out.shape[3])  # (B*T, h, d)
    return out.index_select(0, scatter).unsqueeze(0), None  # (1, N, h, d)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The packed forward's mask: none (the attention builds its layout from the pack)."""
    return None


AttentionInterface.register(ATTENTION, packed_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)


@contextmanager
def _packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Route ``model``'s attention through :func:`packed_attention` for one forward (and its backward).

    The config is shared by every layer, so the switch is one attribute; it is restored whatever happens.
    Not for a model another thread runs at the same time.
    """
    config = cast(PlainHeadLM, model).config  # packable(model), which packed batches are made for
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def packed_states(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The (1, N, H) final-layer states of a packed batch (:func:`pack`), after the final norm."""
    decoder = cast(PlainHeadLM, model).model  # packable(model), which packed batches are made for
    with _packed_attention(model):
        out = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                      use_cache=False, fedmosaic_pack=batch[PACK_KEY])
    return out.last_hidden_state
