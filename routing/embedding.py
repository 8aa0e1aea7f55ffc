"""The request representation FedDPA routes on: the final-layer state of the prompt's last token.

Paper 000 section 4.3: an input's representation is the last-layer hidden state of its last token with
the global adapter on; local instances are embedded the same way, once (end of training, or when a run
is loaded), and cached per client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from adapters import AdaptedModel


def last_token_state(
    model: torch.nn.Module, adapted: AdaptedModel | None, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    names: Sequence[str] = (), weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return (B, H): HF ``hidden_states[-1]`` at each row's last non-pad token (any padding side).

    Args:
        model: the causal LM.
        adapted: its adapter handle (None: the bare model).
        input_ids: (B, T) token ids.
        attention_mask: (B, T), 1 on real tokens.
        names: adapters to switch on (FedDPA: ``("global",)``).
        weights: (B, K) adapter weights; ones when omitted.
    """
    ctx: AbstractContextManager[object] = nullcontext()
    if adapted is not None and names:
        w = weights if weights is not None else torch.ones(input_ids.shape[0], len(names))
        ctx = adapted.context.use(tuple(names), w)
    with torch.inference_mode(), ctx:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # (B, T, H)
    positions = torch.arange(attention_mask.shape[1]).expand_as(attention_mask)
    last = (positions * attention_mask.long()).argmax(dim=1)  # (B,)
    return hidden[torch.arange(hidden.shape[0]), last].float()


def embed_prompts(
    model: torch.nn.Module, adapted: AdaptedModel | None, tokenizer: object, prompts: Sequence[str],
    names: Sequence[str] = (), batch_size: int = 16,
    autocast: Callable[[], AbstractContextManager[object]] | None = None,
) -> np.ndarray:
    """Embed prompt strings in batches; returns (N, H) float32."""
    chunks = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[start:start + batch_size]), return_tensors="pt", padding=True,  # type: ignore[operator]
                        add_special_tokens=False)
        with autocast() if autocast is not None else nullcontext():
            chunks.append(last_token_state(model, adapted, enc["input_ids"], enc["attention_mask"], names))
    if not chunks:
        return np.zeros((0, 0), dtype=np.float32)
    return torch.cat(chunks).numpy().astype(np.float32)
