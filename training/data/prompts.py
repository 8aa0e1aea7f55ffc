"""Prompt templates: the FedDPA paper's short Alpaca template, or the base model's chat template.

Paper 000 and its reference code use ``alpaca_short`` (docs/methods.md 2.3): ``### Instruction:\\n{instruction}
\\n\\n### Response:\\n``; Dolly's ``input`` is folded in as an ``### Input:`` block (the Alpaca layout
FedAMoLE uses, docs/methods.md 1.9). The chat option wraps the same text as one user turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from training.data.records import DataError, Record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ALPACA_SHORT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_SHORT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PromptStyle = Literal["alpaca_short", "chat"]


@dataclass(frozen=True)
class PromptConfig:
    """How a record becomes a prompt.

    Attributes:
        style: ``alpaca_short`` (the paper's template, default) or ``chat`` (the tokenizer's template).
    """

    style: PromptStyle = "alpaca_short"

    def __post_init__(self) -> None:
        if self.style not in ("alpaca_short", "chat"):
            raise DataError(f"PromptConfig.style must be 'alpaca_short' or 'chat', got {self.style!r}")

    @classmethod
    def named(cls, style: str) -> PromptConfig:
        """The config of a style named as text (a run's ``prompt_style`` setting); DataError for another name."""
        return cls(cast(PromptStyle, style))  # __post_init__ rejects any name outside PromptStyle


def user_text(record: Record) -> str:
    """The instruction with the input appended, as one user message (chat style)."""
    return f"{record.instruction}\n\n{record.input}" if record.input.strip() else record.instruction


def format_prompt(record: Record, tokenizer: PreTrainedTokenizerBase | None = None,
                  config: PromptConfig = PromptConfig()) -> str:
    """Return the prompt text for ``record`` (the response follows it directly)."""
    if config.style == "alpaca_short":
        if record.input.strip():
            return ALPACA_SHORT_INPUT.format(instruction=record.instruction, input=record.input)
        return ALPACA_SHORT.format(instruction=record.instruction)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DataError("the chat prompt style needs a tokenizer with a chat template")
    return str(tokenizer.apply_chat_template(  # tokenize=False: the prompt text
        [{"role": "user", "content": user_text(record)}], tokenize=False, add_generation_prompt=True
    ))
