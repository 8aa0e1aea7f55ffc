"""Engine results -> OpenAI response bodies and stream chunks (chat and completions), logprobs included.

Shared by the HTTP routes and the batch runner. Log-probabilities are the model's own (``log_softmax``
of the raw logits, vLLM's default), in OpenAI's shapes:

* completions: ``logprobs: {tokens, token_logprobs, top_logprobs, text_offset}``; with ``echo`` the
  prompt's tokens come first, the first one with ``null`` (nothing predicts it). ``top_logprobs``
  maps token text to log-probability for the ``logprobs`` most likely tokens plus the chosen one.
* chat: ``logprobs: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
  with exactly ``top_logprobs`` alternatives per token.

A stream sends text as it is generated; a choice's log-probabilities travel in its last chunk (the
one with its ``finish_reason``), so a client that concatenates them per choice gets the same lists as
the non-streamed response.

The ``fedmosaic`` field says the mode and the adapter weights used. FedDPA routing details (the
similarity to the client's stored instances, S, lambda) are included only when ``details`` is set
(admin keys, or a server that opts in): with ``knn`` routing they would let a caller probe whether a
text resembles a client's private training data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from serving.engine.request import GenerationResult
from serving.engine.sampling import TokenLogprob
from serving.openai.builders import Choice, finish_reason
from serving.openai.structured import parse_calls
from serving.targets import TargetPlan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PUBLIC_ROUTE_INFO = ("source", "mode")  # what a FedDPA response says without details
FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass(frozen=True)
class Answer:
    """A finished choice: what was asked, how it was served, what came out."""

    choice: Choice
    plan: TargetPlan
    result: GenerationResult


def extension(plan: TargetPlan, result: GenerationResult | None, details: bool = True,
              prompt_format: str = "") -> dict[str, Any]:
    """The ``fedmosaic`` response field: mode, weights used per adapter, routing info, and for chat the
    ``prompt_format`` the messages were rendered in (:attr:`Choice.prompt_format`)."""
    # an AMoLE client decodes with its route, no plain adapters: its plan's weight (1 on the client) stands
    weights = result.adapter_weights if result is not None and plan.mode != "amole" else plan.weights
    info = dict(result.route_info) if result is not None and result.route_info else dict(plan.info or {})
    if plan.mode == "feddpa" and not details:
        info = {k: info[k] for k in PUBLIC_ROUTE_INFO if k in info}
    out = {"mode": plan.mode, "weights": dict(zip(plan.names, weights, strict=True)), "info": info}
    return {**out, "prompt_format": prompt_format} if prompt_format else out


def usage(answers: Sequence[Answer]) -> dict[str, int]:
    """The OpenAI usage object: each prompt counted once, every choice's completion tokens."""
    prompts = {a.choice.prompt_index: a.result.prompt_tokens for a in answers}
    prompt, completion = sum(prompts.values()), sum(a.result.completion_tokens for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class TokenText:
    """Token id -> its text as logprobs show it (special tokens included), memoised per response."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._seen: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._seen.get(token)
        if text is None:
            text = str(self.tokenizer.decode([token], skip_special_tokens=False))  # one id list: one string
            self._seen[token] = text
        return text


def chat_logprobs(text: TokenText, entries: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    """Chat's ``logprobs`` object for the generated tokens, ``k`` alternatives each."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8", errors="replace"))}

    content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:k]]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(text: TokenText, tokens: Sequence[int], entries: Sequence[TokenLogprob | None],
                        offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object; ``offset`` is the text offset of the first token."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries, strict=True):
        s = text(token)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(s, _finite(entry.logprob))
        out["token_logprobs"].append(_finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out


class ChatShape:
    """``chat.completion`` bodies and ``chat.completion.chunk`` events."""

    endpoint = "chat"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, head: dict[str, Any], details: bool,
                 top_logprobs: int | None) -> None:
        self.text, self.head, self.details, self.k = TokenText(tokenizer), head, details, top_logprobs

    def _logprobs(self, result: GenerationResult) -> dict[str, Any] | None:
        if self.k is None or result.logprobs is None:
            return None
        return chat_logprobs(self.text, result.logprobs, self.k)

    def body(self, answers: Sequence[Answer]) -> dict[str, Any]:
        """The whole response."""
        several = len(answers) > 1
        choices = []
        for a in answers:
            message, finish = self._message(a)
            choice: dict[str, Any] = {"index": a.choice.index, "message": {"role": "assistant", **message},
                                      "logprobs": self._logprobs(a.result), "finish_reason": finish}
            if several:
                choice["fedmosaic"] = extension(a.plan, a.result, self.details, a.choice.prompt_format)
            choices.append(choice)
        first = answers[0]
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": usage(answers),
                "fedmosaic": extension(first.plan, first.result, self.details, first.choice.prompt_format)}

    @staticmethod
    def _message(answer: Answer) -> tuple[dict[str, Any], str]:
        """The answer's ``content`` (and ``tool_calls`` when it called tools) and its finish reason."""
        reason = finish_reason(answer.result)
        if not answer.choice.calls:
            return {"content": answer.result.text}, reason
        content, calls = parse_calls(answer.result.text)
        if not calls:
            return {"content": content}, reason
        return {"content": content, "tool_calls": calls}, "tool_calls" if reason == "stop" else reason

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def start(self, choice: Choice) -> dict[str, Any]:
        """The first event of a choice (the assistant role)."""
        return self.chunk(choice.index, {"role": "assistant", "content": ""})

    def delta(self, choice: Choice, text: str) -> dict[str, Any] | None:
        """A text event; None for a choice that may call tools (it arrives whole in its last event)."""
        return None if choice.calls else self.chunk(choice.index, {"content": text})

    def end(self, answer: Answer) -> dict[str, Any]:
        """The last event of a choice: finish reason, its log-probabilities, its ``fedmosaic`` field; for a
        choice that may call tools also its content and ``tool_calls`` (each with its ``index``)."""
        delta: dict[str, Any] = {}
        finish = finish_reason(answer.result)
        if answer.choice.calls:
            message, finish = self._message(answer)
            delta = {k: v for k, v in message.items() if v is not None}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
        event = self.chunk(answer.choice.index, delta, finish, self._logprobs(answer.result))
        event["fedmosaic"] = extension(answer.plan, answer.result, self.details, answer.choice.prompt_format)
        return event


class CompletionShape:
    """``text_completion`` bodies and events."""

    endpoint = "completions"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, head: dict[str, Any], details: bool,
                 logprobs: int | None) -> None:
        self.text, self.head, self.details, self.k = TokenText(tokenizer), head, details, logprobs

    def _logprobs(self, answer: Answer) -> dict[str, Any] | None:
        result, choice = answer.result, answer.choice
        if self.k is None or result.logprobs is None:
            return None
        tokens: list[int] = [e.token for e in result.logprobs]
        entries: list[TokenLogprob | None] = list(result.logprobs)
        if result.prompt_logprobs is not None and choice.prompt_ids:
            tokens = [*choice.prompt_ids, *tokens]
            entries = [*result.prompt_logprobs, *entries]
        return completion_logprobs(self.text, tokens, entries)

    def body(self, answers: Sequence[Answer]) -> dict[str, Any]:
        """The whole response."""
        several = len(answers) > 1
        choices = []
        for a in answers:
            choice: dict[str, Any] = {"index": a.choice.index, "text": a.choice.echo + a.result.text,
                                      "logprobs": self._logprobs(a), "finish_reason": finish_reason(a.result)}
            if several:
                choice["fedmosaic"] = extension(a.plan, a.result, self.details)
            choices.append(choice)
        return {**self.head, "object": "text_completion", "choices": choices, "usage": usage(answers),
                "fedmosaic": extension(answers[0].plan, answers[0].result, self.details)}

    def chunk(self, index: int, text: str, finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self.head, "object": "text_completion",
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def start(self, choice: Choice) -> dict[str, Any]:
        """The first event of a choice (the echoed prompt, or empty text)."""
        return self.chunk(choice.index, choice.echo)

    def delta(self, choice: Choice, text: str) -> dict[str, Any]:
        return self.chunk(choice.index, text)

    def end(self, answer: Answer) -> dict[str, Any]:
        """The last event of a choice: finish reason, its log-probabilities, its ``fedmosaic`` field."""
        event = self.chunk(answer.choice.index, "", finish_reason(answer.result), self._logprobs(answer))
        event["fedmosaic"] = extension(answer.plan, answer.result, self.details)
        return event


def best_of(answers: Sequence[Answer], n: int, per_prompt: int) -> list[Answer]:
    """The ``n`` answers per prompt with the highest cumulative log-probability, best first, re-indexed.

    Args:
        answers: every candidate in choice order (``per_prompt`` a prompt).
        n: answers kept per prompt.
        per_prompt: candidates per prompt (``best_of``).
    """
    kept = []
    for p in range(0, len(answers), per_prompt):
        group = answers[p:p + per_prompt]
        # sorted is stable: equal sums keep the candidates' order
        ranked = sorted(group, key=lambda a: -sum(e.logprob for e in a.result.logprobs or ()))
        for j, a in enumerate(ranked[:n]):
            kept.append(replace(a, choice=replace(a.choice, index=(p // per_prompt) * n + j)))
    return kept
