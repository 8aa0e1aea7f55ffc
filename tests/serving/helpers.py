"""Shared helpers for the serving tests: adapters whose random B makes them change the outputs, a FedDPA run
folder of them, and the API over a tiny stack: a ready in-process client, a free port, a live server's health.
The fixtures built on them are in ``tests/serving/conftest.py``."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi.testclient import TestClient

from adapters import AdaptedModel, LoraConfig, inject, save_adapter
from models import LoadedModel, tiny_llama
from serving.api import create_app
from serving.settings import ServeSettings

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


@contextmanager
def ready_client(settings: ServeSettings, **client: Any) -> Iterator[TestClient]:
    """A TestClient over ``create_app(settings)`` (``client``: TestClient's options), once its stack is loaded."""
    with TestClient(create_app(settings), **client) as opened:
        wait_ready(opened)
        yield opened


def write_feddpa_run(run: Path, clients: Sequence[str], tiny: LoadedModel | None = None,
                     inference_weight: float | None = 0.25, first_seed: int = 10) -> Path:
    """Write a FedDPA-T run folder for the tiny model: ``global`` (seed 1), each client's local adapter (seeds
    ``first_seed``, ``first_seed + 1``...) and ``run.json`` (without ``inference_weight`` when None)."""
    tiny = tiny if tiny is not None else tiny_llama()
    write_adapter(tiny, run / "adapters" / "global", seed=1)
    for i, client in enumerate(clients):
        write_adapter(tiny, run / "adapters" / "clients" / client / "local", seed=first_seed + i)
    meta: dict[str, Any] = {"method": "feddpa-t", "model": "tiny"}
    if inference_weight is not None:
        meta["inference_weight"] = inference_weight
    (run / "run.json").write_text(json.dumps(meta))
    return run


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, tries: int = 600) -> None:
    """Poll ``<url>/health`` (every 50 ms, ``tries`` times) until a live server answers 200; a server still
    starting refuses the connection. Returns either way: the caller's next request says what went wrong."""
    for _ in range(tries):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
