"""Shared fixtures: the tiny random Llama and its offline tokenizer (seconds, CPU only); the ``cuda`` marker.

Tests marked ``cuda`` need a CUDA GPU: they are skipped (with the reason) where torch sees none, so CI
stays CPU-only, and ``make test-gpu`` runs exactly them on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from models import LoadedModel, tiny_llama, tiny_tokenizer


@pytest.fixture()
def tiny() -> LoadedModel:
    """A fresh tiny random Llama (2 layers, hidden 64) with the offline tokenizer."""
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer() -> object:
    """The offline byte-level BPE tokenizer (ChatML template, eos = pad = <|im_end|>)."""
    return tiny_tokenizer()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda``-marked tests when torch sees no CUDA device."""
    del config
    if torch.cuda.is_available():
        return
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch.cuda.is_available() is False ({build})")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
