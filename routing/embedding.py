"""The request representation FedDPA routes on: the final-layer state of the prompt's last token, or their mean.

Paper 000 section 4.3: an input's representation is the last-layer hidden state of its last token with
the global adapter on; local instances are embedded the same way, once (end of training, or when a run
is loaded), and cached per client (``routing.cache``). The request and the cached instances must be
embedded by this one function so their cosines compare like with like.

``pooling="mean"`` is paper 000's Table 10 ablation (average-token embedding): the mean of the
final-layer states over the prompt's real tokens. (The reference code's ``emb_type='avg'`` also
averages the padding positions of its batch, docs/methods.md 2.4; a prompt's embedding here does not
depend on what it was batched with.) An index records its pooling (``routing.cache``): a request is
compared only with instances pooled the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from adapters import AdaptedModel, module_device
from routing.base import Pooling, RoutingError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

POOLINGS: tuple[str, ...] = ("last", "mean")


def check_pooling(pooling: str) -> Pooling:
    """Return ``pooling`` if it is ``last`` or ``mean``, else raise RoutingError."""
    if pooling not in POOLINGS:
        raise RoutingError(f"FedDPA embedding must be 'last' (last token) or 'mean' (average token), got {pooling!r}")
    return cast(Pooling, pooling)  # one of POOLINGS, the values of Pooling


def pool_states(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling = "last") -> torch.Tensor:
    """Pool (B, T, H) final-layer states over each row's real tokens (``mask`` (B, T), any padding side).

    Returns:
        (B, H) float32: the last real token's state (``last``) or the mean over the real tokens (``mean``).
    """
    mask = mask.to(hidden.device).long()
    if check_pooling(pooling) == "mean":
        m = mask.unsqueeze(-1).float()  # (B, T, 1)
        return (hidden.float() * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    # the last real token is the largest index with mask 1, whichever side the padding is on
    index = torch.arange(mask.shape[1], device=hidden.device).expand_as(mask)  # (B, T)
    last = (index * mask).argmax(dim=1)  # (B,)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()


def last_token_state(
    model: torch.nn.Module, adapted: AdaptedModel | None, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    names: Sequence[str] = (), weights: torch.Tensor | None = None, pooling: Pooling = "last",
) -> torch.Tensor:
    """Return (B, H): HF ``hidden_states[-1]`` at each row's last non-pad token (any padding side).

    With ``pooling="mean"``, the mean of ``hidden_states[-1]`` over each row's real tokens instead.

    For Llama ``hidden_states[-1]`` is taken after the final RMSNorm, as in the reference code.
    Position ids follow the attention mask (as in HF generation), so a left-padded row gets the same
    positions as when it runs alone. The inputs may be on any device (a tokenizer gives CPU tensors):
    they are moved to the model's.

    Args:
        model: the causal LM.
        adapted: its adapter handle (None: the bare model).
        input_ids: (B, T) token ids.
        attention_mask: (B, T), 1 on real tokens; every row needs at least one.
        names: adapters to switch on (FedDPA: ``("global",)``).
        weights: (B, K) adapter weights; ones when omitted.
        pooling: ``last`` (paper) or ``mean`` (average token, paper 000 Table 10).

    Returns:
        (B, H) float32 states on the model's device.

    Raises:
        RoutingError: mismatched shapes, or a row with no real token.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise RoutingError(
            f"input_ids and attention_mask must both be (B, T), got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if (attention_mask.sum(dim=1) == 0).any():  # checked where the mask is (no device round trip for CPU masks)
        raise RoutingError("every row needs at least one real token (an all-padding row has no last token)")
    device = module_device(model)
    input_ids, mask = input_ids.to(device), attention_mask.to(device).long()
    ctx: AbstractContextManager[object] = nullcontext()
    if adapted is not None and names:
        # every row at weight 1 unless told: a host row (no sync; a compiled decoder layer traces it whole)
        ctx = (adapted.context.use(tuple(names), weights) if weights is not None
               else adapted.context.uniform(tuple(names), [1.0] * len(names)))
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    with torch.inference_mode(), ctx:
        out = decoder(model)(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             output_hidden_states=True, use_cache=False)
    return pool_states(out.hidden_states[-1], mask, pooling)  # (B, H)


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM's decoder without its LM head (HF ``base_model``), else the model itself.

    The states are the same (the causal LM hands its decoder's ``hidden_states`` through); the head's
    logits over every position (576 x 49,152 a token for SmolLM2, about a fifth of the forward) are not
    needed for an embedding.
    """
    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) and base is not model and hasattr(model, "lm_head") else model


def embed_prompts(
    model: torch.nn.Module, adapted: AdaptedModel | None, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
    names: Sequence[str] = (), batch_size: int = 16,
    autocast: Callable[[], AbstractContextManager[object]] | None = None, pooling: Pooling = "last",
) -> np.ndarray:
    """Embed prompt strings in batches with :func:`last_token_state`.

    Prompts are batched in order of length so a batch pads little; the result keeps the input order.
    The prompts are tokenised as given (no special tokens added): pass them exactly as the template
    formatted them for training, and format requests the same way.

    Args:
        model: the causal LM.
        adapted: its adapter handle (None: the bare model).
        tokenizer: an HF tokenizer with a pad token.
        prompts: N prompt strings.
        names: adapters on, each at weight 1 (FedDPA: ``("global",)``).
        batch_size: prompts per forward.
        autocast: factory of the compute context (e.g. ``LoadedModel.autocast``).
        pooling: ``last`` token (paper) or ``mean`` over the prompt's tokens.

    Returns:
        (N, H) float32; ``(0, 0)`` for no prompts.
    """
    if batch_size < 1:
        raise RoutingError(f"batch_size must be >= 1, got {batch_size}")
    prompts = list(prompts)
    if not prompts:
        return np.zeros((0, 0), dtype=np.float32)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    out: np.ndarray | None = None
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        enc = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True,
                        add_special_tokens=False)
        with autocast() if autocast is not None else nullcontext():
            states = last_token_state(model, adapted, enc["input_ids"], enc["attention_mask"], names,
                                      pooling=pooling)  # (b, H)
        if out is None:
            out = np.empty((len(prompts), states.shape[1]), dtype=np.float32)
        out[chunk] = states.cpu().numpy()  # numpy (and the faiss index built from it) lives on the CPU
    assert out is not None
    return out
