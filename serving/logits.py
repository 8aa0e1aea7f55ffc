"""What happens to a row's logits before sampling, and the log-probabilities a response reports.

Processors, in vLLM's order: ``min_tokens`` forbids end-of-sequence and stop tokens until that many
tokens were generated; ``logit_bias`` adds a bias per token id (OpenAI); the repetition penalty
divides positive and multiplies negative logits of every token seen in the prompt or the output
(CTRL, Keskar et al. 2019; HF and vLLM); presence and frequency penalties subtract
``presence * [count > 0] + frequency * count`` over the generated tokens (OpenAI). Temperature,
top-k and top-p follow in :mod:`serving.sampling`.

Log-probabilities are those of the model's own distribution (``log_softmax`` of the raw logits,
before any processor or temperature: vLLM's default ``raw_logprobs``), for the chosen token and the
``k`` most likely ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serving.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities.

    Attributes:
        token: the token at this position (generated, or the prompt's).
        logprob: its log-probability under the model.
        top: the ``k`` most likely tokens at this position, as (token id, log-probability), best first.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RowHistory:
    """What the processors read about one row: its prompt, its output so far, its end tokens."""

    prompt: Sequence[int]
    output: Sequence[int]
    eos: frozenset[int]


def needs_processing(params: SamplingParams, history: RowHistory) -> bool:
    """True when any processor changes this row's logits now."""
    return bool((params.min_tokens and len(history.output) < params.min_tokens)
                or params.logit_bias or params.repetition_penalty != 1.0
                or params.presence_penalty or params.frequency_penalty)


def process(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[RowHistory]) -> torch.Tensor:
    """Return ``logits`` (B, V) with each row's processors applied (a copy when anything changes).

    Rows without processors cost nothing; the others build their few index tensors on the host and
    update their row on the device.
    """
    rows = [b for b in range(len(params)) if needs_processing(params[b], history[b])]
    if not rows:
        return logits
    out = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    for b in rows:
        p, h = params[b], history[b]
        row = out[b]  # (V,) view
        if p.min_tokens and len(h.output) < p.min_tokens:
            banned = sorted({t for t in (*h.eos, *p.stop_token_ids) if 0 <= t < vocab})
            if banned:
                row[torch.tensor(banned, device=dev)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
            row.index_add_(0, ids, torch.tensor([v for _, v in p.logit_bias], device=dev, dtype=row.dtype))
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.prompt) | set(h.output)), device=dev, dtype=torch.long)
            if seen.numel():
                values = row.index_select(0, seen)
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and h.output:
            counts = Counter(h.output)
            ids = torch.tensor(list(counts), device=dev, dtype=torch.long)
            n = torch.tensor(list(counts.values()), device=dev, dtype=row.dtype)
            row.index_add_(0, ids, -(p.frequency_penalty * n + p.presence_penalty))
    return out


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under (N, V) ``logits`` and each position's top ``ks[i]``.

    One device-to-host read for all positions.
    """
    if not len(tokens):
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1))  # (N, 1)
    k = max(max(ks), 0)
    if k:
        top_v, top_i = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # (N, k)
        packed = torch.cat([chosen, top_v, top_i.to(logp.dtype)], dim=1).tolist()  # ids exact below 2^24
    else:
        packed = chosen.tolist()
    out = []
    for row, token, want in zip(packed, tokens, ks, strict=True):
        top = tuple((int(row[1 + k + j]), float(row[1 + j])) for j in range(min(want, k)))
        out.append(TokenLogprob(int(token), float(row[0]), top))
    return out
