"""The engine's scheduler runs a step's passes and returns each row's outcome; the engine records it.

(That the engine then fails a failing router's request alone: test_engine_faults.py.)

The scheduler (serving/engine/scheduler.py) owns no request state of its own and calls nothing back in
the engine: a row's sampled token, or the exception that fails it, comes back in the order the rows went
through, and only :meth:`Engine.step` appends tokens, streams them and ends sequences.
"""

from __future__ import annotations

import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from tests.serving.engine.test_engine_batching import requests
from tests.serving.helpers import adapted_with


def _admitted(engine: Engine, reqs: list[GenerationRequest]) -> list:  # type: ignore[type-arg]
    handles = [engine.submit(r) for r in reqs]
    engine._admit([])
    return [next(s for s in engine._active if s.handle is h) for h in handles]


def test_the_scheduler_returns_each_rows_token_and_leaves_recording_to_the_engine(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4, runner="hf"))
    seqs = _admitted(engine, requests(3))
    with torch.inference_mode():
        first = engine.scheduler.plan(seqs, engine.config.max_prefill_tokens, reserve=True)
        tokens, outcomes = engine.scheduler.run(first, [])
    assert tokens == sum(len(s.ids) for s in seqs)
    assert [s for s, _ in outcomes] == seqs  # every prompt ended its prefill: one outcome each, in order
    assert all(isinstance(o, tuple) and isinstance(o[0], int) for _, o in outcomes)
    assert all(s.output == [] and s.phase == "decode" for s in seqs)  # no token recorded by the scheduler
    # the engine's own step, from the same state, records exactly those tokens
    alone = Engine(tiny, engine.adapted, EngineConfig(max_batch_size=4, runner="hf"))
    again = _admitted(alone, requests(3))
    alone.step()
    assert [s.output[0] for s in again] == [o[0] for _, o in outcomes]  # type: ignore[index]


def test_a_failing_router_comes_back_as_that_rows_outcome_and_fails_it_alone(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=4, runner="hf"))

    def broken(state: torch.Tensor, ids: object) -> tuple[list[float], dict[str, object]]:
        raise RuntimeError("index unreadable")

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    routed = GenerationRequest(prompt="Sort these words", sampling=params, adapter_names=("g", "l1"),
                               adapter_weights=(1.0, 0.0), prefill_weights=(1.0, 0.0), weight_fn=broken)
    plain = requests(2)[0]
    seqs = _admitted(engine, [routed, plain])
    with torch.inference_mode():
        _, outcomes = engine.scheduler.run(engine.scheduler.plan(seqs, 512, reserve=True), [])
    by_row = {id(s): o for s, o in outcomes}
    assert isinstance(by_row[id(seqs[0])], RuntimeError) and "index unreadable" in str(by_row[id(seqs[0])])
    assert isinstance(by_row[id(seqs[1])], tuple)  # the plain row beside it took its token
    assert all(s in engine._active and not s.handle.done for s in seqs)  # the scheduler ends nothing itself
