"""``bench.serving.amole`` times AMoLE's serving step on the model's own device (issue 46).

It made its prompt ids on the CPU and failed on CUDA at its first forward: it runs here under the
CPU-side device check (the model on :class:`tests.devicecheck.ShadowDevice`'s pretend ``cuda:0``) and,
with ``make test-gpu``, on a real GPU.
"""

from __future__ import annotations

import pytest
import torch

from bench.serving import amole as bench
from models import tiny_llama
from tests.devicecheck import ShadowDevice

CASES = {"base", "lora_per_row", "amole_1_client", "amole_8_clients", "amole_8_recorded"}


def test_the_amole_serving_benchmark_runs_on_the_models_device() -> None:
    loaded = tiny_llama()
    with ShadowDevice() as shadow:
        shadow.move(loaded.model)
        out = bench.measure(loaded, batch=2, tokens=4, steps=1, repeats=1, experts=8)
    assert out["device"] == "cuda:0" and set(out["results"]) == CASES


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_amole_serving_benchmark_runs_on_cuda() -> None:
    out = bench.measure(tiny_llama(device="cuda"), batch=4, tokens=8, steps=2, repeats=1, experts=8)
    assert out["device"] == "cuda:0" and out["results"]["amole_8_clients"]["decode_step_s"] > 0
