"""Sampling: the per-request decoding parameters and the logits -> next-token rule.

Temperature 0 is greedy (argmax, as HF ``generate(do_sample=False)``); otherwise logits are divided by
the temperature, filtered by top-k then top-p (nucleus, Holtzman et al. 2020), and one token is drawn
with the request's own ``torch.Generator`` so a seed reproduces a completion whatever else shares the
batch. Stop strings are matched on decoded text by :mod:`serving.request`, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    Attributes:
        max_tokens: generated tokens at most (finish reason ``length`` when reached).
        temperature: 0 is greedy; otherwise the softmax temperature (> 0).
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        stop: strings that end the completion; the first match and what follows are trimmed.
        seed: seeds the request's generator; None draws a fresh seed.
        ignore_eos: keep decoding past the end-of-sequence token (benchmarks).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """Return the request's CPU generator (None for greedy: nothing random is drawn)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator().manual_seed(seed)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (V,) logits outside the top-k and the top-p nucleus with -inf."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the most likely always stays.
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from one row's (V,) logits.

    Args:
        logits: (V,) next-token logits of one sequence.
        params: its sampling parameters.
        generator: its generator (ignored when greedy).

    Returns:
        The chosen token id.
    """
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class TextTracker:
    """Incremental detokenization with stop strings, for streaming deltas that never need retracting.

    The whole completion is decoded after every token (byte-level BPE decoding is prefix-stable), and
    text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or in a prefix of a stop
    string, so a client never sees half a character or the start of a stop string.
    """

    def __init__(self, tokenizer: object, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self._longest = max((len(s) for s in stop), default=0)

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; return (text delta to emit, True when a stop string matched)."""
        self.ids.append(token_id)
        previous = len(self.text)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        if self.stop:
            start = max(0, previous - self._longest)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._emit(len(self.text)), True
        return self._emit(self._safe_length()), False

    def flush(self) -> str:
        """Return the text not yet emitted (at the end of the request)."""
        return self._emit(len(self.text))

    def _safe_length(self) -> int:
        end = len(self.text)
        while end > self.emitted and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, end), 0, -1):
                if self.text[end - n:end] == s[:n]:
                    hold = max(hold, n)
                    break
        end -= hold
        return max(end, self.emitted)

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
