"""The engine under the default dtype policy, ``autocast-bf16`` (fp32 weights, bf16 compute and KV cache).

The other engine tests run the tiny model in float32, where every tensor already has the cache's dtype;
SmolLM2 is served with ``autocast-bf16`` by default (``FEDMOSAIC_DTYPE``), so the same paths run here on
the tiny model with that policy.
"""

from __future__ import annotations

import dataclasses

import pytest

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.request import GenerationRequest
from serving.sampling import SamplingParams
from tests.serving.helpers import adapted_with

# Regression: found by bench/serve_throughput.py on SmolLM2, every request failed with 500 under the
# default dtype (reference kernels wrote fp32 rotated keys into the bf16 cache and masked bf16 scores
# with the float32 minimum).


@pytest.fixture()
def autocast_tiny(tiny: LoadedModel) -> LoadedModel:
    """The tiny model under the default serving policy: fp32 weights, bf16 autocast, bf16 KV cache."""
    return dataclasses.replace(tiny, dtype="autocast-bf16")


@pytest.mark.parametrize("names", [(), ("g", "l1")])
def test_autocast_requests_complete(autocast_tiny: LoadedModel, names: tuple[str, ...]) -> None:
    """Base and adapter requests finish normally (not 500) when the engine computes in bf16."""
    engine = Engine(autocast_tiny, adapted_with(autocast_tiny), EngineConfig(max_batch_size=4))
    assert engine.kv.k[0].dtype.is_floating_point and str(engine.kv.k[0].dtype) == "torch.bfloat16"
    weights = tuple(1.0 / len(names) for _ in names)
    requests = [GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                  adapter_names=names, adapter_weights=weights)
                for p in ("The capital of France is", "Sort these words")]
    results = engine.generate(requests)
    assert [(r.finish_reason, r.error, r.completion_tokens) for r in results] == [("length", None, 6)] * 2
