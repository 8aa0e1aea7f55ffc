"""Shared helpers for the serving tests: adapters whose random B makes them change the outputs, and waiting
for an app to be ready."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from adapters import AdaptedModel, LoraConfig, inject, save_adapter
from models import LoadedModel

CONFIG = LoraConfig(r=4, alpha=8.0, dropout=0.0)


def randomize(adapted: AdaptedModel, name: str, seed: int, scale: float = 0.5) -> None:
    """Give adapter ``name`` a random B (PEFT's init leaves it zero, i.e. no effect)."""
    gen = torch.Generator().manual_seed(seed)
    for _, layer in adapted.adapter_layers(name):
        adapter = layer.adapters[name]
        B = torch.randn(adapter.lora_B.shape, generator=gen) * scale
        layer.set_weights(name, adapter.lora_A.detach().clone(), B)


def adapted_with(tiny: LoadedModel, names: tuple[str, ...] = ("g", "l1", "l2")) -> AdaptedModel:
    """Inject the tiny model and add randomised adapters ``names``."""
    adapted = inject(tiny.model)
    for i, name in enumerate(names):
        adapted.add_adapter(name, CONFIG, seed=i)
        randomize(adapted, name, seed=100 + i)
    return adapted


def write_adapter(tiny: LoadedModel, folder: Path, seed: int) -> Path:
    """Write a randomised PEFT adapter folder for the tiny model (the model is left unchanged)."""
    adapted = inject(tiny.model)
    try:
        adapted.add_adapter("tmp", CONFIG, seed=seed)
        randomize(adapted, "tmp", seed=1000 + seed)
        save_adapter(adapted, "tmp", folder)
    finally:
        adapted.remove()
    return folder


def wait_ready(client: TestClient, seconds: float = 30.0) -> None:
    """Poll ``/health`` until the app answers 200 (the stack loads in its own thread)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(client.get("/health").json())
