"""Shared set-up of the serving tests: the HTTP API over a tiny stack served live, and a trained FedDPA run.

An in-process client is ``tests.serving.helpers.ready_client`` (a context manager: several tests open a
few apps one after another); what needs a teardown at the end of a module or session is a fixture here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from models import tiny_llama
from serving.api import create_app
from serving.settings import ServeSettings
from tests.serving.helpers import free_port, wait_healthy


@pytest.fixture(scope="module")
def live_server() -> Iterator[Callable[..., str]]:
    """Start uvicorn on ``create_app(settings)`` in a thread and return its URL once ``/health`` answers.

    The factory's keyword arguments go to ``uvicorn.Config`` (default: 127.0.0.1, a free port, warnings
    only, no websockets); every server started is stopped at the end of the module.
    """
    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(settings: ServeSettings, **config: Any) -> str:
        config = {"host": "127.0.0.1", "log_level": "warning", "ws": "none", **config}
        config.setdefault("port", free_port())
        server = uvicorn.Server(uvicorn.Config(create_app(settings), **config))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        started.append((server, thread))
        url = f"http://{config['host']}:{config['port']}"
        wait_healthy(url)
        return url

    try:
        yield start
    finally:
        for server, thread in started:
            server.should_exit = True
            thread.join(timeout=30)


@pytest.fixture(scope="session")
def feddpa_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FedDPA-T run trained two rounds on the tiny model (clients ``sorting`` and ``capitals``, their
    embedding indexes and calibrations): read-only, so a test that changes it works on a copy."""
    from training.data import generate_suite  # here: collecting the serving tests needs no training
    from training.federation.rounds import RoundConfig
    from training.local.runtime import preset
    from training.simulation import SimConfig, run_federated

    out = tmp_path_factory.mktemp("feddpa") / "run"
    run_federated("feddpa-t", generate_suite(n_train=6, n_test=2, families=["sorting", "capitals"]), tiny_llama(),
                  out, SimConfig(RoundConfig(rounds=2)), preset("tiny"), {"alpha": 0.5}, data_spec="generated",
                  model_name="tiny")
    return out
