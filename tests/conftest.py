"""Shared fixtures: the tiny random Llama and its offline tokenizer (seconds, CPU only)."""

from __future__ import annotations

import pytest

from fedmosaic.models import LoadedModel
from fedmosaic.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture()
def tiny() -> LoadedModel:
    """A fresh tiny random Llama (2 layers, hidden 64) with the offline tokenizer."""
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer() -> object:
    """The offline byte-level BPE tokenizer (ChatML template, eos = pad = <|im_end|>)."""
    return tiny_tokenizer()
