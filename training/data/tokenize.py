"""Tokenization for causal-LM fine-tuning: prompt masked out of the loss, EOS appended, cutoff.

As the FedDPA reference (alpaca-lora, docs/methods.md 2.3: ``train_on_inputs=False``, ``cutoff_len`` 512):
``input_ids = prompt + response + EOS`` with labels ``-100`` over the prompt, truncated to the cutoff,
the EOS kept only when it fits. Batches are padded with the tokenizer's pad id and label ``-100``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from training.data.prompts import PromptConfig, format_prompt
from training.data.records import DataError, Record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One tokenized training example (lists of token ids, same length)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


def tokenize_record(
    record: Record, tokenizer: PreTrainedTokenizerBase, cutoff_len: int = 512, prompt: PromptConfig = PromptConfig()
) -> Example:
    """Tokenize one record with the prompt masked (-100), EOS appended, truncated to ``cutoff_len``."""
    if cutoff_len < 2:
        raise DataError(f"cutoff_len must be >= 2, got {cutoff_len}")
    text = format_prompt(record, tokenizer, prompt)
    p_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(record.output, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    ids = list(p_ids) + list(r_ids)
    if len(ids) < cutoff_len:
        ids.append(eos)
    ids = ids[:cutoff_len]
    n_prompt = min(len(p_ids), len(ids))
    labels = [IGNORE] * n_prompt + ids[n_prompt:]
    return Example(tuple(ids), tuple(labels))


def prompt_texts(records: Sequence[Record], tokenizer: PreTrainedTokenizerBase | None = None,
                 prompt: PromptConfig = PromptConfig()) -> list[str]:
    """Prompts only, for generation and for embeddings."""
    return [format_prompt(r, tokenizer, prompt) for r in records]


def collate(examples: Sequence[Example], pad_id: int, left: bool = False,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Pad a batch: ``input_ids`` with ``pad_id``, ``labels`` with -100, an ``attention_mask``.

    Args:
        examples: tokenized examples.
        pad_id: the tokenizer's pad token id.
        left: pad on the left (generation, FedDPA's reference) instead of the right (training).
        device: where the batch goes (the model's device); it is built on the CPU and copied once.
    """
    if not examples:
        raise DataError("cannot collate an empty batch")
    width = max(len(e.input_ids) for e in examples)
    # filled row by row from Python lists on the host, then copied to the device in one go
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long, device="cpu")
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(examples), width), dtype=torch.long, device="cpu")
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        sl = slice(width - n, width) if left else slice(0, n)
        ids[i, sl] = torch.tensor(e.input_ids, device="cpu")
        labels[i, sl] = torch.tensor(e.labels, device="cpu")
        mask[i, sl] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}
