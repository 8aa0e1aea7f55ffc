"""Static-batch generation with HF ``generate`` over the adapter context (greedy or beam search).

Prompts are left-padded into batches, each row gets its adapter weights (``(B, K)`` over named
adapters, the contract of ``adapters/context.py``) and HF ``generate`` decodes (the layers repeat each
row's weights for beams). Serving's beam-search path (``serving/beam.py``) and training's
validation of a client's local adapter (``training/federation/local_gate.py``) both decode through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from adapters.context import weight_matrix
from adapters.device import module_device
from adapters.inject import AdaptedModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings.

    Attributes:
        max_new_tokens: generated tokens per prompt at most.
        num_beams: 1 is greedy (the default of our protocol); the FedDPA reference used 4.
        batch_size: prompts per forward batch.
    """

    max_new_tokens: int = 64
    num_beams: int = 1
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_beams", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerationConfig.{name} must be a positive integer, got {value!r}")


def generate(
    adapted: AdaptedModel | None,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    names: Sequence[str] = (),
    weights: torch.Tensor | Sequence[Sequence[float]] | Sequence[float] | None = None,
    config: GenerationConfig = GenerationConfig(),
    autocast: object | None = None,
) -> list[str]:
    """Generate a completion for every prompt, row ``i`` with adapter weights ``weights[i]``.

    Args:
        adapted: the injected model (None for a bare base model).
        model: the HF causal LM (``adapted.model`` when injected).
        tokenizer: its tokenizer (a pad token is required).
        prompts: already-templated prompt strings.
        names: adapter names, K of them; empty for the base model.
        weights: ``(len(prompts), K)``; one row ``(K,)`` applies to all prompts; None with no names.
        config: decoding settings.
        autocast: a context-manager factory for the compute dtype (e.g. ``LoadedModel.autocast``).

    Returns:
        The decoded completions (prompt excluded, special tokens removed, stripped).
    """
    if names and adapted is None:
        raise ValueError("adapter names were given but the model has no adapters injected")
    device = module_device(model)
    w = _weights(names, weights, len(prompts)).to(device)
    outputs: list[str] = []
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(prompts), config.batch_size):
            batch = list(prompts[start:start + config.batch_size])
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(device) for k, v in enc.items()}  # the tokenizer gives CPU tensors
            kwargs = dict(
                max_new_tokens=config.max_new_tokens,
                num_beams=config.num_beams,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            with torch.inference_mode(), (autocast() if callable(autocast) else _null()):
                # HF's GenerationMixin.generate (ids without return_dict_in_generate); typed through
                # nn.Module's __getattr__ it would read as Tensor | Module
                hf_generate = cast("Callable[..., torch.Tensor]", model.generate)
                if adapted is not None and names:
                    with adapted.context.use(tuple(names), w[start:start + len(batch)]):
                        out = hf_generate(**enc, **kwargs)
                else:
                    out = hf_generate(**enc, **kwargs)
            new = out[:, enc["input_ids"].shape[1]:]
            outputs.extend(t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
    return outputs


def _weights(names: Sequence[str], weights: torch.Tensor | Sequence[Sequence[float]] | Sequence[float] | None,
             n: int) -> torch.Tensor:
    if not names:
        return torch.zeros(n, 0, device="cpu")  # validated on the host, moved by the caller
    if weights is None:
        raise ValueError(f"weights are required for adapters {list(names)}")
    if isinstance(weights, torch.Tensor):
        w = weights
    else:  # rows of weights over the same names: the one builder (adapters.context.weight_matrix)
        rows = _rows(weights)
        w = weight_matrix([(tuple(names), r) for r in rows])[1] if all(len(r) == len(names) for r in rows) \
            else torch.tensor(rows, dtype=torch.float32)
    if w.dim() == 1:
        w = w.unsqueeze(0)
    if w.shape[0] == 1 and n != 1:
        w = w.expand(n, -1)
    if w.dim() != 2 or w.shape != (n, len(names)):
        raise ValueError(f"weights must have shape ({n}, {len(names)}), got {tuple(w.shape)}")
    return w


def _rows(weights: Sequence[Sequence[float]] | Sequence[float]) -> list[list[float]]:
    """Rows of weights, or the one row ``weights`` is (the first item tells which: mypy cannot narrow on it)."""
    if weights and isinstance(weights[0], Sequence):
        return [list(r) for r in cast("Sequence[Sequence[float]]", weights)]
    return [list(cast("Sequence[float]", weights))]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
