"""Grammar-constrained decoding: compiled grammars, their per-row matchers, and the token masks they apply.

A request that must answer in a structure (a JSON schema, tool calls) carries a :class:`Grammar` in its
:class:`~serving.engine.sampling.SamplingParams`; the engine gives each of its rows (each choice of
``n``) a matcher of its own (:meth:`Grammar.matcher`). Before a step samples, every constrained row's
matcher writes the tokens it allows into one packed bitmask (32 tokens an ``int32`` word) and the
disallowed tokens' logits become ``-inf`` (:func:`apply_masks`), after the processors and before the
temperature, top-k/p and the draw, greedy rows included; rows without a grammar are untouched. Each
sampled token then advances its row's matcher; the end-of-sequence token is allowed only where the
grammar can end, and accepting it terminates the matcher. The mask depends on the row's text alone,
never on its adapters, so FedDPA and AMoLE rows are constrained alike.

The grammar engine is xgrammar (``bench/serving/grammar_overhead.py`` measured it against llguidance and
outlines-core on SmolLM2's vocabulary; bench/serving/HISTORY.md has the figures). This module knows
grammars and tokens only: what a JSON schema or a tool call means to an OpenAI client is the wire floor's
(:mod:`serving.openai.structured`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.errors import InvalidRequest


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled for one tokenizer; every row that uses it gets its own matcher.

    Attributes:
        compiled: xgrammar's compiled grammar.
        name: what it constrains to, for messages ("JSON schema 'answer'", "tool calls").
    """

    compiled: Any = field(repr=False)
    name: str = "grammar"

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        import xgrammar as xgr  # only where a grammar is used: the engine runs without the serve extra too

        words = (int(self.compiled.tokenizer_info.vocab_size) + 31) // 32
        return GrammarMatcher(xgr.GrammarMatcher(self.compiled), self.name, words)


class GrammarMatcher:
    """One row's position in its grammar (engine thread only)."""

    def __init__(self, matcher: Any, name: str, words: int) -> None:
        self._m, self.name, self.words = matcher, name, words  # words: int32 words of its bitmask row

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (R, ceil(V / 32)) int32 on the CPU."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            InvalidRequest: the grammar does not allow ``token`` here (a mask was not applied).
        """
        if not self._m.accept_token(token):
            raise InvalidRequest(f"token {token} breaks the request's {self.name}; the output cannot follow it")

    @property
    def done(self) -> bool:
        """True once the grammar accepted its end (the end-of-sequence token after a complete structure)."""
        return bool(self._m.is_terminated())


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, W) int32 packed bitmask -> (R, vocab) bool, token ``t`` allowed when bit ``t % 32`` of word ``t // 32``.

    Tokens past the mask's ``W * 32`` (model rows beyond the tokenizer's vocabulary) are disallowed.
    """
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # (32,)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (R, W, 32), bit 31 read through the sign as 1 or -1 & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # (R, W * 32)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(bitmask.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """Return ``logits`` (B, V) with each constrained row's disallowed tokens at ``-inf`` (a copy when any row is).

    Every constrained row writes its mask into one CPU bitmask, moved to the logits' device in one copy.
    """
    rows = [b for b, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    constrained = [m for m in matchers if m is not None]
    bitmask = torch.zeros(len(rows), constrained[0].words, dtype=torch.int32)  # (R, W): one tokenizer's width
    for r, matcher in enumerate(constrained):
        matcher.fill(bitmask, r)
    vocab = logits.shape[-1]
    allowed = unpack(bitmask.to(logits.device), vocab)  # (R, V)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))  # (R, V)
    return logits.index_copy(0, index, masked)


class GrammarCompiler:
    """Compiles grammars for one tokenizer (xgrammar caches compiled grammars by their source).

    Args:
        tokenizer: the served model's Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
        self._lock = threading.Lock()  # compilation runs in request threads

    def json_schema(self, schema: dict[str, Any], name: str, strict: bool = True, param: str = "response_format"
                    ) -> Grammar:
        """Any JSON text valid under ``schema``, compact (``", "`` and ``": "`` separators, no other whitespace).

        Args:
            schema: a JSON schema (the caller checked its keywords).
            name: for messages.
            strict: objects take only the properties their schema declares unless ``additionalProperties``
                allows more; False reads JSON Schema's own default (any other property allowed).

        Raises:
            InvalidRequest: xgrammar cannot compile the schema.
        """
        return self._compile(lambda: self._compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=strict), name, param)

    def structural_tag(self, tag: dict[str, Any], name: str, param: str = "tools") -> Grammar:
        """xgrammar's structural tag (text with tagged, schema-constrained regions).

        Raises:
            InvalidRequest: xgrammar cannot compile it (a parameters schema it refuses).
        """
        return self._compile(lambda: self._compiler.compile_structural_tag(json.dumps(tag)), name, param)

    def _compile(self, build: Callable[[], Any], name: str, param: str) -> Grammar:
        try:
            with self._lock:
                return Grammar(build(), name)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequest(f"the {name} cannot be compiled into a grammar: {exc}",
                                 param=param) from exc
