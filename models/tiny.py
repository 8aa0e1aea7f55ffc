"""Tiny random Llama models and an offline byte-level BPE tokenizer, for fast tests and examples.

The tokenizer is trained in a few milliseconds on a fixed corpus, so it is identical on every
machine and needs no download. Its special tokens mirror SmolLM2's (``<|endoftext|>`` 0,
``<|im_start|>`` 1, ``<|im_end|>`` 2 as end-of-sequence and padding) and it carries a ChatML
chat template, so code written against SmolLM2 runs unchanged on the tiny model.
"""

from __future__ import annotations

import functools
import string
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack, cast

import torch

from models import settings
from models.loaded import LoadedModel, frozen

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "### Instruction:\n", "\n\n### Response:\n", "### Input:\n",
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.",
    "The capital of France is Paris. The capital of Italy is Rome. Convert 5 km to meters.",
    "What is the sentiment of this review? positive negative neutral OPTIONS: yes no maybe",
    "Sort these words alphabetically: apple banana cherry. Add punctuation. Segment the words.",
    "Reformat the date 2024-03-15 as March 15, 2024. twelve plus seven equals nineteen.",
    string.ascii_letters + string.digits + string.punctuation + " \n\t",
]


@functools.lru_cache(maxsize=2)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Return a deterministic ``PreTrainedTokenizerFast`` built offline (byte-level BPE)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_llama(
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: settings.DType = "float32",
) -> LoadedModel:
    """Build a tiny random Llama (GQA, tied embeddings, like SmolLM2) with the offline tokenizer.

    The weights are drawn on the CPU from ``seed`` and then moved, so the model is the same on every
    device.

    Args:
        vocab_size: tokenizer and embedding size.
        hidden_size: model width; the LoRA targets ``q_proj``/``v_proj`` have this many inputs.
        num_layers: decoder layers.
        num_heads: attention heads; ``num_kv_heads`` must divide it.
        num_kv_heads: key/value heads.
        intermediate_size: MLP width.
        seed: torch seed for the random weights.
        device: where the model lives (``cpu``, ``cuda``, ``cuda:N``, ``auto`` or a ``torch.device``).
        dtype: ``float32`` (default: exact tests), ``bfloat16`` weights or ``autocast-bf16``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.config.name_or_path = "fedmosaic/tiny-llama"
    if dtype not in settings.DTYPES:
        raise ValueError(f"dtype must be one of {settings.DTYPES}, got {dtype!r}")
    target, torch_dtype = settings.resolve_device(device), torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model.to(device=target, dtype=torch_dtype)  # type: ignore[call-arg]  # transformers' @wraps'd .to reads unbound
    return frozen(model, tokenizer, "tiny", dtype)  # the name that loads it again (run.json records it)


class TinySize(TypedDict, total=False):
    """The integer options of :func:`tiny_llama` (the sizes and the seed), for :func:`save_tiny_llama`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seed: int


def save_tiny_llama(folder: Path, **kwargs: Unpack[TinySize]) -> Path:
    """Write a tiny random Llama and its tokenizer as a normal HF model folder."""
    loaded = tiny_llama(**kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    cast("PreTrainedModel", loaded.model).save_pretrained(str(folder))  # tiny_llama's model is a LlamaForCausalLM
    loaded.tokenizer.save_pretrained(str(folder))
    return folder
