"""vLLM's ``/tokenize`` and ``/detokenize`` bodies, and the pure functions answering them.

``/tokenize`` takes a completion's ``prompt`` or a chat's ``messages`` (rendered as
``/v1/chat/completions`` renders them for that ``model``: the chat template with the same
``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``, or the trained
template of a run's target) and answers ``{count, max_model_len, tokens, token_strs}``.
``add_special_tokens`` defaults to false, unlike vLLM: the count is then exactly the prompt tokens a
completion of the same text costs here (the engine adds no special tokens to a prompt).
``/detokenize`` answers ``{prompt}``: the text of ``tokens``, special tokens kept, so a tokenized chat
prompt round-trips.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from serving.errors import InvalidRequest
from serving.openai.schemas import ChatMessage, Strict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizeCompletionRequest(Strict):
    """``POST /tokenize`` with a completion's ``prompt``."""

    model: str | None = Field(None, min_length=1, description="a served name (default: the base model)")
    prompt: str
    add_special_tokens: bool = Field(False, description="add the tokenizer's special tokens (BOS); the engine "
                                     "adds none to a prompt")
    return_token_strs: bool = Field(False, description="also answer each token's text")


class TokenizeChatRequest(Strict):
    """``POST /tokenize`` with a chat's ``messages``, rendered as ``/v1/chat/completions`` renders them."""

    model: str | None = Field(None, min_length=1, description="a served name (default: the base model)")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    """``POST /detokenize``: token ids -> text."""

    model: str | None = Field(None, min_length=1, description="a served name (default: the base model)")
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool, token_strs: bool,
             max_model_len: int) -> TokenizeResponse:
    """The token ids of ``text`` (and their texts when asked).

    Raises:
        InvalidRequest: the text cannot be tokenized (lone surrogates).
    """
    try:
        ids = [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
    except (UnicodeError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"the prompt is not valid text ({type(exc).__name__}: {exc})", param="prompt") from exc
    strs = [str(s) for s in tokenizer.convert_ids_to_tokens(ids)] if token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> DetokenizeResponse:
    """The text of ``tokens``, special tokens kept.

    Raises:
        InvalidRequest: a token id outside the vocabulary (named).
    """
    vocab = len(tokenizer)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=str(tokenizer.decode(tokens, skip_special_tokens=False)))
