"""OpenAI request bodies -> engine inputs: one :class:`Choice` per prompt and per ``n``.

Shared by the HTTP routes (:mod:`serving.api.routes`) and the offline batch runner
(:mod:`serving.batch`), so a batch-file line and an HTTP request with the same body get the same
prompts and sampling parameters; :mod:`serving.openai.responses` builds the response bodies. Pure
functions: no FastAPI, no server state.

A completions ``prompt`` may be a string, a list of strings, token ids or a list of token-id lists;
each prompt yields ``n`` choices, indexed ``prompt * n + j`` (vLLM's order). With a ``seed``, choice
``j`` of a prompt samples with ``seed + j`` (vLLM's rule for ``n > 1``), so choices differ and a
request is reproducible; without one every choice draws fresh entropy. A completion's ``best_of``
yields that many candidates per prompt instead, of which the response keeps ``n``
(:func:`serving.openai.responses.best_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serving.engine.request import GenerationResult
from serving.engine.sampling import SEED_RANGE, SamplingParams
from serving.errors import EngineNotReady, GenerationFailed, InvalidRequest, RequestTimedOut
from serving.openai import chat_format, compat, structured
from serving.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Limits:
    """The server's limits applied to every request.

    Attributes:
        max_tokens_limit: the largest ``max_tokens`` allowed.
        default_max_tokens: ``max_tokens`` when a request sets none (capped at the limit).
        max_choices: choices one request may ask for (prompts x n, or x best_of).
        defaults: the model's sampling defaults for fields a request leaves unset (its generation config's
            ``max_new_tokens`` stands in for ``default_max_tokens``).
    """

    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_choices: int = 64
    defaults: compat.SamplingDefaults = compat.SamplingDefaults()


@dataclass(frozen=True)
class Choice:
    """One engine request of a response.

    Attributes:
        index: the choice's ``index`` in the response.
        prompt_index: which prompt of the request it answers.
        prompt: prompt text, or None when ``prompt_ids`` is given.
        prompt_ids: prompt token ids.
        sampling: its decoding parameters (its own seed).
        echo: text put before the completion (completions' ``echo``), else "".
        shared_prefix: the leading text of ``prompt`` that is the chat template's own (before the first
            message's content): the same for every caller, so other tenants' cached KV may serve it.
        calls: the answer may hold tool calls (:mod:`serving.openai.structured`), returned as ``tool_calls``.
        prompt_format: how a chat request's messages were rendered: ``chat_template``, or the trained
            template of the target's run (:mod:`serving.openai.chat_format`); "" for completions.
    """

    index: int
    prompt_index: int
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    sampling: SamplingParams
    echo: str = ""
    shared_prefix: str = ""
    prompt_format: str = ""
    calls: bool = False


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """What ``apply_chat_template`` gets beside the messages: vLLM's ``add_generation_prompt`` (default
    on), ``continue_final_message`` and the request's ``chat_template_kwargs``."""
    return {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt is not False,
            "continue_final_message": bool(body.continue_final_message)}


def chat_prompt(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest) -> str:
    """The chat-templated prompt of ``body`` (the assistant turn opened unless the request says otherwise).

    Raises:
        InvalidRequest: the tokenizer's chat template rejects the messages.
    """
    messages = [m.template_dict() for m in body.messages]
    try:
        return str(tokenizer.apply_chat_template(  # tokenize=False: the prompt text
            messages, tokenize=False, **template_kwargs(body)))
    except Exception as exc:  # templates raise on unsupported role orders
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc


def template_prefix(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest, prompt: str) -> str:
    """The leading text of the chat ``prompt`` the template writes before the first message's content.

    It is the server's text (the template's markup, a default system prompt), not the caller's: the
    messages are rendered again with a marker for the first content, and the text before the marker
    counts when ``prompt`` starts with it ("" otherwise).
    """
    marker = "\x00fedmosaic-content\x00"
    messages = [m.template_dict() for m in body.messages]
    messages[0] = {**messages[0], "content": marker}
    try:
        probe = str(tokenizer.apply_chat_template(  # tokenize=False: the prompt text
            messages, tokenize=False, **template_kwargs(body)))
    except Exception:  # noqa: BLE001 - a template refusing the marker: nothing is shared
        return ""
    head = probe.split(marker, 1)[0] if marker in probe else ""
    return head if prompt.startswith(head) else ""


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    """``text``'s token ids as the engine tokenizes a prompt (no special tokens added).

    Raises:
        InvalidRequest: the text cannot be tokenized (lone surrogates).
    """
    try:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    except (UnicodeError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"the prompt is not valid text ({type(exc).__name__}: {exc})", param="prompt") from exc


def decode(tokenizer: PreTrainedTokenizerBase, ids: tuple[int, ...] | list[int]) -> str:
    """The text of token ids (special tokens skipped, as completions are)."""
    try:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))  # one id list: one string
    except (IndexError, OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"prompt token ids do not decode: {exc}", param="prompt") from exc


def requested_max_tokens(body: SamplingFields) -> int | None:
    """``max_completion_tokens`` when a chat request sets it, else ``max_tokens``."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def logprob_counts(body: SamplingFields) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for the engine: top alternatives per token, None when not asked."""
    if isinstance(body, ChatCompletionRequest):
        return ((body.top_logprobs or 0) if body.logprobs else None), None
    if isinstance(body, CompletionRequest):
        return body.logprobs, (body.logprobs if body.echo and body.logprobs is not None else None)
    return None, None


def child_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice ``j`` of a prompt: ``seed + j``, wrapped into the generator's range."""
    if seed is None or j == 0:
        return seed
    low, high = SEED_RANGE
    return (seed + j - low) % (high - low + 1) + low


def sampling_params(body: SamplingFields, limits: Limits, seed: int | None = None) -> SamplingParams:
    """The engine's sampling parameters, with the server's token limits applied.

    Raises:
        InvalidRequest: ``max_tokens`` above the limit, or a parameter the engine refuses (named).
    """
    asked = requested_max_tokens(body)
    explicit = bool(body.model_fields_set & {"max_tokens", "max_completion_tokens"})
    if asked is None:  # the model's generation config's max_new_tokens, else the server's default
        tokens = min(limits.defaults.max_tokens or limits.default_max_tokens, limits.max_tokens_limit)
    elif not explicit:  # the wire default (completions: OpenAI's 16) yields to a lower server limit
        tokens = min(asked, limits.max_tokens_limit)
    else:
        tokens = asked
    if tokens > limits.max_tokens_limit:
        raise InvalidRequest(f"max_tokens is {tokens}; this server allows at most {limits.max_tokens_limit}",
                             param="max_tokens")
    min_tokens = body.min_tokens or 0
    if min_tokens > tokens:
        raise InvalidRequest(f"min_tokens ({min_tokens}) exceeds max_tokens ({tokens})", param="min_tokens")
    logprobs, prompt_logprobs = logprob_counts(body)
    if compat.picks_best(body) and logprobs is None:
        logprobs = 0  # best_of ranks the candidates by their tokens' log-probabilities
    pick = limits.defaults.pick
    bias = tuple(sorted((int(t), float(b)) for t, b in (body.logit_bias or {}).items()))
    try:
        return SamplingParams(
            max_tokens=tokens, temperature=pick(body, "temperature", 1.0), top_p=pick(body, "top_p", 1.0),
            top_k=max(int(pick(body, "top_k", 0)), 0), min_p=pick(body, "min_p", 0.0), stop=body.stop_strings(),
            seed=seed,
            ignore_eos=bool(body.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=_or(body.presence_penalty, 0.0), frequency_penalty=_or(body.frequency_penalty, 0.0),
            repetition_penalty=pick(body, "repetition_penalty", 1.0), logit_bias=bias, min_tokens=min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()))
    except ValueError as exc:
        message = str(exc)
        raise InvalidRequest(message, param=message.split(" ", 1)[0]) from exc


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def choices(body: SamplingFields, tokenizer: PreTrainedTokenizerBase, limits: Limits,
            trained_style: str | None = None) -> list[Choice]:
    """Every engine request ``body`` asks for, in response order.

    ``trained_style`` (:func:`serving.openai.chat_format.trained_style`) renders a chat request's messages
    in the template its target's run trained with; None applies the tokenizer's chat template.

    Raises:
        InvalidRequest: too many choices, a limit exceeded, or a prompt the tokenizer refuses.
    """
    n = compat.candidates(body)  # n, or best_of candidates to pick n from (serving.openai.compat)
    prompts: list[str | list[int]]
    shared = form = ""
    structure = structured.Structure()
    if isinstance(body, ChatCompletionRequest):  # response_format and tools: a grammar, tools in the prompt
        structure = structured.plan(body, tokenizer)
        body = structured.prompt_body(body, structure, trained_style is None and structured.native_tools(tokenizer))
    if isinstance(body, ChatCompletionRequest) and trained_style is not None:
        prompts = [chat_format.trained_prompt(body.messages, trained_style, bool(body.continue_final_message))]
        form = trained_style
        shared = chat_format.template_head(trained_style)
    elif isinstance(body, ChatCompletionRequest):
        chat = chat_prompt(tokenizer, body)
        prompts, shared, form = [chat], template_prefix(tokenizer, body, chat), "chat_template"
    elif isinstance(body, CompletionRequest):
        prompts = body.prompts()
    else:
        raise TypeError(f"not a generation request: {type(body).__name__}")
    if len(prompts) * n > limits.max_choices:
        what = "best_of" if compat.picks_best(body) else "n"
        raise InvalidRequest(f"{len(prompts)} prompt(s) x {what} = {n} asks for {len(prompts) * n} choices; this "
                             f"server answers at most {limits.max_choices} per request", param=what)
    first = structured.constrain(sampling_params(body, limits, body.seed), structure)  # validates once, first
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    out = []
    for p, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
        if text is not None and first.prompt_logprobs is not None:
            ids = encode(tokenizer, text)  # echo's logprobs name every prompt token, the first one included
        shown = "" if not echo else text if text is not None else decode(tokenizer, ids or ())
        for j in range(n):
            sampling = first if j == 0 else structured.constrain(
                sampling_params(body, limits, child_seed(body.seed, j)), structure)
            out.append(Choice(p * n + j, p, text if ids is None else None, ids, sampling, shown, shared, form,
                              calls=structure.calls))
    return out


def finish_reason(result: GenerationResult) -> str:
    """The OpenAI finish reason; an engine error, deadline or shutdown surfaces as its domain error.

    Raises:
        InvalidRequest: the request caused the failure (400).
        RequestTimedOut: the server's deadline passed (504).
        GenerationFailed: the server failed (500; the message names the request id).
        EngineNotReady: the request was cancelled by a shutdown (503).
    """
    if result.finish_reason == "error":
        message = result.error or f"generation of request {result.request_id} failed"
        if result.error_status == 400:
            raise InvalidRequest(message)
        if result.error_status == 504:
            raise RequestTimedOut(message)
        raise GenerationFailed(message)
    if result.finish_reason == "cancelled":
        raise EngineNotReady("the request was cancelled (server shutting down)")
    return result.finish_reason
