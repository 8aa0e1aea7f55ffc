"""The demo against a served FedAMoLE run: AMoLE clients listed, answers carry expert usage, heatmap drawn."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvicorn

from demos.client import ApiClient, ApiError
from demos.handlers import INSTRUCTION, Handlers
from demos.heatmap import find_expert_usage
from serving.api import create_app
from serving.settings import ServeSettings
from tests.serving.test_amole_serving import write_amole


@pytest.fixture(scope="module")
def amole(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiClient, dict[str, dict[str, list[int]]]]]:
    run = tmp_path_factory.mktemp("amole-demo") / "run"
    assignments = write_amole(run / "adapters" / "amole", seed=0)
    (run / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny"}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = create_app(ServeSettings(model="tiny", run_dir=Path(run)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = ApiClient(f"http://127.0.0.1:{port}", timeout=60)
    for _ in range(600):
        try:
            if client.health():
                break
        except ApiError:
            time.sleep(0.1)
    try:
        yield client, assignments
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=20)


def test_amole_answer_draws_the_expert_heatmap(amole: tuple[ApiClient, dict[str, dict[str, list[int]]]]) -> None:
    client, assignments = amole
    h = Handlers(client)
    _, target, *_ = h.refresh()
    labels = dict((v, k) for k, v in target["choices"])
    assert labels["c0"] == "c0 — client (AMoLE experts)" and target["value"] in ("c0", "c1", "c2")
    *_, (history, _, route, ext, heat) = list(h.chat("Sort these words", [], "c0", INSTRUCTION, 5, 0.0))
    assert ext["mode"] == "amole" and "**per token**" in route
    assert history[-1]["metadata"]["title"].startswith("⚖️ c0: AMoLE · top-2")
    assert heat["visible"] is True
    usage = find_expert_usage(ext)
    assert usage is not None and set(usage.layers) == set(assignments["c0"])
    counts = np.asarray(heat["value"].axes[0].images[0].get_array())  # (layers, experts) as drawn
    assert counts.shape == (len(usage.layers), 6)
    np.testing.assert_array_equal(counts, np.asarray(usage.counts))
    # every counted position picks top_k experts in every layer, and only experts assigned to c0
    np.testing.assert_array_equal(counts.sum(axis=1), np.full(len(usage.layers), 2 * usage.tokens))
    for i, layer in enumerate(usage.layers):
        outside = [j for j in range(6) if j not in assignments["c0"][layer]]
        assert counts[i, outside].sum() == 0
