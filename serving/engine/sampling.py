"""The logits pipeline of a step: per-request parameters, processors, temperature, top-k/p, the draw.

Processors, in vLLM's order: ``min_tokens`` forbids end-of-sequence and stop tokens until that many
tokens were generated; ``logit_bias`` adds a bias per token id (OpenAI); the repetition penalty
divides positive and multiplies negative logits of every token seen in the prompt or the output
(CTRL, Keskar et al. 2019; HF and vLLM); presence and frequency penalties subtract
``presence * [count > 0] + frequency * count`` over the generated tokens (OpenAI).

Temperatures below :data:`GREEDY_BELOW` are greedy (argmax, as HF ``generate(do_sample=False)`` and
as vLLM treats tiny temperatures: dividing by 1e-45 overflows to inf and NaN probabilities).
Otherwise logits are divided by the temperature, filtered by min-p (a token less likely than ``min_p``
times the most likely one is dropped; vLLM's order: after the temperature, before top-k), by top-k
then top-p (nucleus, Holtzman et al. 2020), and each sampled row draws its token with its own
``torch.Generator`` on the model's device (an exponential race over the probabilities, equivalent to
a categorical draw), so a seed reproduces a completion on a given device whatever else shares the
batch. The whole batch is sampled on the device and read back with one transfer per step. Stop strings are matched on
decoded text by :class:`serving.engine.text.TextTracker`.

Log-probabilities are those of the model's own distribution (``log_softmax`` of the raw logits,
before any processor or temperature: vLLM's default ``raw_logprobs``), for the chosen token and the
``k`` most likely ones.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from serving.engine.grammar import Grammar, GrammarMatcher

GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # top log-probabilities per position (OpenAI's chat limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    Attributes:
        max_tokens: generated tokens at most (finish reason ``length`` when reached).
        temperature: below 1e-5 is greedy; otherwise the softmax temperature.
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        min_p: in [0, 1]; drop the tokens whose probability (after the temperature) is below ``min_p``
            times the most likely token's; 0 keeps every token (vLLM).
        stop: up to 16 strings of at most 256 characters that end the completion; the first match
            and what follows are trimmed.
        seed: seeds the request's generator (a 64-bit integer); None draws a fresh seed.
        ignore_eos: keep decoding past the end-of-sequence token (benchmarks).
        logprobs: report each generated token's log-probability and its this many most likely
            alternatives (0: the token's only; None: nothing); at most 20.
        prompt_logprobs: likewise for every prompt token (the completions API's ``echo``).
        presence_penalty: subtracted once from every generated token's logit (OpenAI), in [-2, 2].
        frequency_penalty: subtracted per occurrence of every generated token (OpenAI), in [-2, 2].
        repetition_penalty: > 0; divides positive and multiplies negative logits of every prompt
            or generated token (1 disables it).
        logit_bias: (token id, bias in [-100, 100]) pairs added to the logits (OpenAI).
        min_tokens: end-of-sequence and ``stop_token_ids`` are impossible before this many tokens.
        stop_token_ids: token ids that end the completion (the token is kept in ``token_ids``).
        grammar: the structure the output must follow (:mod:`serving.engine.grammar`); each row gets
            its own matcher, and the completion ends when the grammar does.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    grammar: Grammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.min_p, int | float) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if len(self.stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} characters")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, int | float) or not math.isfinite(self.repetition_penalty) \
                or not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be a number in (0, 100], got {self.repetition_penalty!r}")
        bad_bias = [pair for pair in self.logit_bias if len(pair) != 2 or not isinstance(pair[0], int)
                    or pair[0] < 0 or not isinstance(pair[1], int | float) or not -100 <= pair[1] <= 100]
        if bad_bias or len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias maps distinct token ids >= 0 to biases in [-100, 100]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """Return the request's generator on ``device`` (None for greedy: nothing random is drawn)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


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
    """What the processors read about one row: its prompt, its output so far, its end tokens, its grammar's matcher."""

    prompt: Sequence[int]
    output: Sequence[int]
    eos: frozenset[int]
    matcher: GrammarMatcher | None = None


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


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (B, V) logits outside each row's top-k and top-p nucleus with -inf.

    Args:
        logits: (B, V) already divided by the temperatures.
        top_k: (B,) long, 0 keeps every token.
        top_p: (B,) float in (0, 1].
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # (1, V)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    # the k-th value ties are kept, as a value threshold would
    kth = sorted_logits.gather(1, (k - 1).clamp(min=0))
    drop &= sorted_logits < kth
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # drop a token once the mass before it already reaches top_p; the most likely always stays
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (B, V) logits whose probability is below ``min_p`` (B,) times their row's largest with -inf.

    In log space: ``logit < max + log(min_p)`` (a 0 keeps the row whole); the most likely token always stays.
    """
    top = logits.max(dim=-1, keepdim=True).values  # (B, 1)
    floor = top + torch.log(min_p.to(logits.dtype)).unsqueeze(1)  # (B, 1); log(0) = -inf keeps all
    return logits.masked_fill(logits < floor, float("-inf"))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
    """Pick the next token of every row of ``logits`` (B, V); one device-to-host read.

    Args:
        logits: (B, V) next-token logits.
        params: each row's sampling parameters.
        generators: each row's generator (None for greedy rows), on the logits' device.
    """
    logits = logits.float()
    # max(dim).indices is argmax (the first maximum, NaN included) in 0.4x its time on a CPU: 1.6 ms less
    # per step at 64 rows of a 49k vocabulary
    tokens = logits.max(dim=-1).indices  # (B,): greedy rows keep this
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = logits.device
        index = torch.tensor(sampled, device=dev)
        temps = torch.tensor([params[b].temperature for b in sampled], device=dev).unsqueeze(1)
        rows = logits.index_select(0, index) / temps  # (S, V)
        if any(params[b].min_p > 0 for b in sampled):
            rows = min_p_filter(rows, torch.tensor([params[b].min_p for b in sampled], device=dev))
        if any(params[b].top_k > 0 or params[b].top_p < 1 for b in sampled):
            rows = filter_logits(rows, torch.tensor([params[b].top_k for b in sampled], device=dev),
                                 torch.tensor([params[b].top_p for b in sampled], device=dev))
        probs = torch.softmax(rows, dim=-1)  # (S, V)
        noise = torch.stack([torch.empty(rows.shape[1], device=dev).exponential_(generator=generators[b])
                             for b in sampled])  # (S, V), each row from its own generator
        tokens = tokens.index_copy(0, index, (probs / noise).max(dim=-1).indices)
    return tokens.tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from one row's (V,) logits (see :func:`sample_batch`)."""
    return sample_batch(logits.unsqueeze(0), [params], [generator])[0]


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
