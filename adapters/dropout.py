"""LoRA dropout on the adapter's input, its masks drawn as 32-bit random words (LoRA dropout, docs/methods.md).

PEFT applies ``nn.Dropout(lora_dropout)`` to each adapter's input (paper 000 and its reference code: 0.05
on q and v). The semantics are the same here: each element is zeroed with probability ``p`` and the rest
are scaled by ``1 / (1 - p)``, a fresh mask per adapter and per forward.

Why not ``F.dropout``: on the CPU a mask element costs about 10 ns through ``bernoulli_`` (one
Mersenne-twister draw and a float compare per element), and ``torch.compile``'s inductor draws it element
by element in its own generated loop, slower still, which took away most of what compiling the decoder
layers gains. Here a mask comes from 64-bit random words, two 32-bit draws each (``random_`` over the
full int64 range), compared against ``round(p * 2**32)``: a drop probability within ``2**-33`` of ``p``
(``bernoulli_``'s float uniform resolves ``2**-24``). The draw is one opaque custom op, so a compiled layer
calls it as it is and fuses the compare and the scaling into its own code. Every device takes this one
path (its own generator draws the words), so eager and compiled layers, and the CPU and a GPU, share
the same arithmetic. Every LoRA dropout of the project draws here: the dense adapters' (``LoraDropout``),
the gathered (row, adapter) pairs' of a mixed batch (``lora_dropout_rows``) and AMoLE's experts'
(``adapters.amole``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_SPAN = 2**32


# ``nonce``, a fresh empty tensor per call, keeps two draws for the same input apart: AOT autograd's CSE
# would merge two calls with equal arguments into one mask (it knows only aten's random ops, and never
# merges ``empty``). A functional op, not an in-place fill: inductor fused a read of a filled buffer
# ahead of the fill (torch 2.13, a decoder layer's graph).
@torch.library.custom_op("fedmosaic::random_words", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _random_words(like: torch.Tensor, nonce: torch.Tensor) -> torch.Tensor:
    n = like.numel()
    words = torch.empty((n + 1) // 2, dtype=torch.int64, device=like.device).random_(-(2**63), None)
    return words.view(torch.int32)[:n].view(like.shape)  # two 32-bit words per 64-bit draw


@_random_words.register_fake
def _random_words_fake(like: torch.Tensor, nonce: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=torch.int32, device=like.device)


def random_words(like: torch.Tensor) -> torch.Tensor:
    """Uniform random int32 words shaped like ``like`` (its values unused), from its device's generator."""
    return _random_words(like, torch.empty(0, device=like.device))


def drop_threshold(p: float) -> int:
    """The int32 word below which an element is dropped: ``round(p * 2**32)`` words of ``2**32`` drop."""
    return -(2**31) + round(p * _SPAN)


def lora_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout of ``x`` (any shape): zero with probability ``p``, scale the rest by ``1 / (1 - p)``.

    Args:
        x: the adapter's input.
        p: drop probability, ``0 <= p < 1``.
        training: dropout is applied only when True (``p = 0`` is the identity too).

    Returns:
        A tensor like ``x``; ``x`` itself when nothing is dropped.

    Raises:
        ValueError: ``p`` outside ``[0, 1)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    if not training or p == 0.0:
        return x
    keep = random_words(x) >= drop_threshold(p)  # (..., d) bool
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def lora_dropout_rows(x: torch.Tensor, rates: Sequence[float], index: torch.Tensor) -> torch.Tensor:
    """Inverted dropout of each row of ``x`` at its own rate: row ``i`` at ``rates[index[i]]``.

    The gathered path of a multi-adapter layer (``adapters.layer``) stacks one input row per (row, adapter)
    pair; each pair is dropped at its adapter's rate, from the same words and thresholds as
    :func:`lora_dropout`.

    Args:
        x: (N, ...) the gathered adapter inputs.
        rates: each adapter's drop probability, ``0 <= p < 1``.
        index: (N,) long, row ``i``'s adapter in ``rates``.

    Returns:
        A tensor like ``x``; ``x`` itself when every rate is 0.

    Raises:
        ValueError: a rate outside ``[0, 1)``.
    """
    for p in rates:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    if not any(rates):
        return x
    shape = (-1,) + (1,) * (x.dim() - 1)  # one value per leading row, broadcast over the rest
    thresholds = torch.tensor([drop_threshold(p) for p in rates], dtype=torch.int64, device=x.device)[index]
    scales = torch.tensor([1.0 / (1.0 - p) for p in rates], dtype=x.dtype, device=x.device)[index]
    keep = random_words(x) >= thresholds.view(shape)  # (N, ...) bool
    return x * keep.to(x.dtype) * scales.view(shape)


class LoraDropout(nn.Module):
    """``nn.Dropout``'s place in a LoRA adapter, with :func:`lora_dropout`'s masks (follows ``.train()``)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
