"""Remembered routing states (serving.engine.route_states): a prompt routed once skips its routing pass.

The same prompt for several clients (FedDPA's test-time personalization, every client on every task)
runs its routing pass once: the later requests get the same state, hence the same weights and tokens as
without the memory, and run one prompt pass instead of two. Never across tenants, pooling rules or
changed adapters; a ``weight_fn`` that fails on a remembered state fails its request only.
"""

from __future__ import annotations

import pytest
import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.route_states import RouteStates
from serving.engine.sampling import SamplingParams
from tests.serving.helpers import adapted_with, randomize

PROMPT = "Sort these words: pear, apple, fig."


def routed(local: str, states: list[torch.Tensor], scope: str = "", pooling: str = "last",
           fail: bool = False, exact: bool = True) -> GenerationRequest:
    """A FedDPA-style request: routing pass on ``g`` alone, then ``g`` and ``local`` at a state-dependent mix."""

    def route(state: torch.Tensor, ids: object) -> tuple[tuple[float, float], dict[str, object]]:
        if fail:
            raise ValueError("this client's index is unreadable")
        states.append(state.clone())
        a = float(torch.sigmoid(state.float().sum() / 100))  # depends on the state, as FedDPA's does
        return (1 - a, a), {}

    return GenerationRequest(prompt=PROMPT, adapter_names=("g", local), adapter_weights=(0.5, 0.5),
                             prefill_weights=(1.0, 0.0), weight_fn=route, exact_prefill=exact, state_pooling=pooling,
                             cache_scope=scope, sampling=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))


def prompt_tokens(engine: Engine) -> list[int]:
    seen: list[int] = []
    engine.step_observers.append(lambda report: seen.append(report.prefill_tokens))
    return seen


@pytest.fixture()
def engines(tiny: LoadedModel) -> tuple[Engine, Engine]:
    adapted = adapted_with(tiny)
    config = EngineConfig(max_batch_size=2, prefix_cache_slots=0)  # the prefix cache apart: this memory alone
    return Engine(tiny, adapted, config), Engine(tiny, adapted, EngineConfig(max_batch_size=2, prefix_cache_slots=0,
                                                                             route_state_cache=0))


def test_a_prompt_for_another_client_reuses_the_state_and_decodes_the_same(engines: tuple[Engine, Engine]) -> None:
    remembering, plain = engines
    n = len(remembering.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    tokens = prompt_tokens(remembering)
    seen: list[torch.Tensor] = []
    reference: list[torch.Tensor] = []
    outs = [remembering.generate([routed(local, seen)])[0] for local in ("l1", "l2")]
    refs = [plain.generate([routed(local, reference)])[0] for local in ("l1", "l2")]
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert len(seen) == len(reference) == 2
    torch.testing.assert_close(seen[1], reference[1], rtol=0, atol=0)  # the very state the pass gave
    assert remembering.route_states.hits == 1 and plain.route_states.hits == 0 and len(plain.route_states) == 0
    assert sum(tokens) == 3 * n  # l1: routing and exact pass; l2: the exact pass only


def test_no_reuse_across_tenants_pooling_or_changed_adapters(engines: tuple[Engine, Engine]) -> None:
    remembering, _ = engines
    seen: list[torch.Tensor] = []
    remembering.generate([routed("l1", seen, scope="tenant-a")])
    remembering.generate([routed("l2", seen, scope="tenant-b")])  # another tenant: its own pass
    remembering.generate([routed("l2", seen, scope="tenant-a", pooling="mean")])  # another state
    remembering.generate([routed("l2", seen, scope="tenant-a", exact=False)])  # decodes from its routing pass's KV
    assert remembering.route_states.hits == 0
    remembering.generate([routed("l2", seen, scope="tenant-a")])
    assert remembering.route_states.hits == 1
    randomize(remembering.adapted, "g", seed=11)  # the global adapter changed in place: a new state
    remembering.generate([routed("l1", seen, scope="tenant-a")])
    assert remembering.route_states.hits == 1
    assert not torch.equal(seen[-1], seen[0])


def test_a_failing_weight_fn_on_a_remembered_state_fails_its_request_only(engines: tuple[Engine, Engine]) -> None:
    remembering, _ = engines
    seen: list[torch.Tensor] = []
    remembering.generate([routed("l1", seen)])
    bad, good = remembering.generate([routed("l2", seen, fail=True), routed("l2", seen)])
    assert bad.finish_reason == "error" and "unreadable" in (bad.error or "")
    assert good.finish_reason == "length" and len(good.token_ids) == 5
    assert remembering.failure is None


def test_the_least_recently_used_state_is_forgotten() -> None:
    states = RouteStates(2)
    for i in range(3):
        states.put(("g",), "", "last", [i], torch.full((4,), float(i)))
    assert states.get(("g",), "", "last", [0]) is None and len(states) == 2
    assert torch.equal(states.get(("g",), "", "last", [2]), torch.full((4,), 2.0))  # type: ignore[arg-type]
    assert states.get(None, "", "last", [2]) is None  # an AMoLE pass (no key) is never remembered
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        RouteStates(-1)
    with pytest.raises(ValueError, match="route_state_cache must be >= 0"):
        EngineConfig(route_state_cache=-1)

