"""Prompt-prefix reuse (serving.engine.prefix_cache): the same tokens as without it, and reuse only where exact."""

from __future__ import annotations

import pytest
import torch

from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from tests.serving.helpers import adapted_with, randomize

SYSTEM = "You are a careful assistant who answers briefly. "


def ask(question: str, weights: tuple[float, float] = (0.5, 0.5), **kw: object) -> GenerationRequest:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return GenerationRequest(prompt=SYSTEM + question, sampling=params, adapter_names=("g", "l1"),
                             adapter_weights=weights)


@pytest.fixture()
def engines(tiny: LoadedModel) -> tuple[Engine, Engine]:
    adapted = adapted_with(tiny)
    # routing states are not remembered here (serving.engine.route_states): every routing pass runs, and reuses
    return (Engine(tiny, adapted, EngineConfig(max_batch_size=4, prefix_cache_slots=2, route_state_cache=0)),
            Engine(tiny, adapted, EngineConfig(max_batch_size=4, prefix_cache_slots=0, route_state_cache=0)))


def test_a_shared_prefix_is_reused_and_decodes_as_without_the_cache(engines: tuple[Engine, Engine]) -> None:
    cached, plain = engines
    first, second = ask("Name a colour."), ask("Name a fruit.")
    shared = 0
    ids = [cached.tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in (first, second)]  # type: ignore[operator]
    while ids[0][shared] == ids[1][shared]:
        shared += 1
    out = [cached.generate([r])[0].token_ids for r in (first, second, first)]
    assert out == [plain.generate([r])[0].token_ids for r in (first, second, first)]
    assert cached.prefixes.hits == 2
    # the second prompt replaced the first in its spare (they share the system prompt): the repeat reuses that
    assert cached.prefixes.reused_tokens == 2 * shared
    cached.generate([first])
    assert cached.prefixes.reused_tokens == 2 * shared + len(ids[0]) - 1  # an exact repeat computes its last token
    assert plain.prefixes.hits == 0


def test_other_weights_or_changed_adapters_never_reuse(tiny: LoadedModel, engines: tuple[Engine, Engine]) -> None:
    cached, plain = engines
    cached.generate([ask("Name a colour.")])
    cached.generate([ask("Name a colour.", weights=(0.3, 0.7))])
    assert cached.prefixes.hits == 0
    randomize(cached.adapted, "l1", seed=77)  # the same internal name, new tensors: its cached KV is stale
    again = ask("Name a colour.")
    assert cached.generate([again])[0].token_ids == plain.generate([again])[0].token_ids
    assert cached.prefixes.hits == 0


def test_the_least_recently_used_prompt_is_replaced(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=2, prefix_cache_slots=1))
    a, b = GenerationRequest(prompt="alpha beta gamma", sampling=SamplingParams(max_tokens=2, temperature=0)), \
        GenerationRequest(prompt="delta epsilon", sampling=SamplingParams(max_tokens=2, temperature=0))
    for request in (a, b, a):
        engine.generate([request])
    assert engine.prefixes.hits == 0  # b replaced a in the one spare slot
    engine.generate([a])
    assert engine.prefixes.hits == 1


def test_prompts_sharing_a_prefix_take_one_spare(engines: tuple[Engine, Engine]) -> None:
    """Prompts differing after a shared system prompt replace each other, so another key keeps its spare."""
    cached, plain = engines  # two spares
    alone = GenerationRequest(prompt=SYSTEM + "Name a tree.", adapter_names=("g",), adapter_weights=(1.0,),
                              sampling=SamplingParams(max_tokens=2, temperature=0))
    cached.generate([alone])
    for question in ("Name a colour.", "Name a fruit.", "Name a bird."):
        request = ask(question)
        assert cached.generate([request])[0].token_ids == plain.generate([request])[0].token_ids
    assert len(cached.prefixes._entries) == 2
    hits = cached.prefixes.hits
    cached.generate([alone])  # not pushed out by the three mixtures: its whole prompt is still held
    assert cached.prefixes.hits == hits + 1


def test_prompt_logprobs_compute_every_token(engines: tuple[Engine, Engine]) -> None:
    cached, _ = engines
    with_logprobs = ask("Name a colour.", prompt_logprobs=1)
    first = cached.generate([with_logprobs])[0]
    again = cached.generate([with_logprobs])[0]
    assert cached.prefixes.hits == 0 and again.prompt_logprobs == first.prompt_logprobs


def routed(question: str, states: list[torch.Tensor], pooling: str = "last", a: float = 0.5) -> GenerationRequest:
    def route(state: torch.Tensor, ids: object) -> tuple[tuple[float, float], dict[str, object]]:
        states.append(state)
        return (1 - a, a), {}

    return GenerationRequest(prompt=SYSTEM + question, adapter_names=("g", "l1"), adapter_weights=(0.5, 0.5),
                             prefill_weights=(1.0, 0.0), weight_fn=route, exact_prefill=True, state_pooling=pooling,
                             sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


def test_a_reused_prefix_outlives_prompts_never_reused(tiny: LoadedModel) -> None:
    """A burst of one-off prompts (FedDPA exact passes at per-prompt weights) replaces one another, not the
    spare that later prompts keep reusing."""
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=2, prefix_cache_slots=2))
    shared = GenerationRequest(prompt=SYSTEM + "Name a tree.", adapter_names=("g",), adapter_weights=(1.0,),
                               sampling=SamplingParams(max_tokens=1, temperature=0))
    engine.generate([shared])
    engine.generate([shared])
    assert engine.prefixes.hits == 1
    for w in (0.1, 0.2, 0.3):
        engine.generate([ask("Name a colour.", weights=(1 - w, w))])
    engine.generate([shared])
    assert engine.prefixes.hits == 2


def test_routing_passes_share_the_prefix_of_the_global_adapter_alone(engines: tuple[Engine, Engine]) -> None:
    """A FedDPA routing pass runs (global 1, local 0): it reuses a `global` request's prefix, and its
    state and tokens are the full pass's up to rounding."""
    cached, plain = engines
    ids = cached.tokenizer(SYSTEM + "Name a fruit.", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    alone = GenerationRequest(prompt=SYSTEM + "Name a colour.", adapter_names=("g",), adapter_weights=(1.0,),
                              sampling=SamplingParams(max_tokens=2, temperature=0))
    cached.generate([alone])
    seen: list[torch.Tensor] = []
    reference: list[torch.Tensor] = []
    out = cached.generate([routed("Name a fruit.", seen)])[0]
    assert cached.prefixes.hits == 1 and 0 < cached.prefixes.reused_tokens < len(ids) - 1
    assert out.token_ids == plain.generate([routed("Name a fruit.", reference)])[0].token_ids
    torch.testing.assert_close(seen[0], reference[0], atol=1e-5, rtol=1e-5)
    cached.generate([routed("Name a fruit.", seen)])  # both passes of the repeat reuse: routing and exact
    assert cached.prefixes.hits == 3
    torch.testing.assert_close(seen[1], reference[0], atol=1e-5, rtol=1e-5)


def test_a_burst_of_exact_passes_keeps_the_prefix_every_routing_pass_shares(engines: tuple[Engine, Engine]) -> None:
    """Clients' exact passes (each at weights routed for its own prompt) go in together after their routing
    passes, before any later prompt could reuse the global adapter's prefix: they must not push it out."""
    cached, plain = engines  # two spares
    questions = ("Name a colour.", "Name a fruit.", "Name a bird.")

    def burst() -> list[list[int]]:
        requests = [routed(q, [], a=a) for q, a in zip(questions, (0.2, 0.4, 0.6), strict=True)]
        return [r.token_ids for r in cached.generate(requests)]

    first = burst()
    assert cached.prefixes.hits == 0
    assert first == [r.token_ids for r in plain.generate([routed(q, [], a=a) for q, a in
                                                         zip(questions, (0.2, 0.4, 0.6), strict=True)])]
    assert burst() == first
    assert cached.prefixes.hits == 3 + 1  # every routing pass, and the last exact pass (kept) for its repeat
    assert sum(e.own for e in cached.prefixes._entries.values()) == 1  # the three took one spare in turn


def test_a_pass_at_its_own_weights_is_dropped_rather_than_evict(tiny: LoadedModel) -> None:
    engine = Engine(tiny, adapted_with(tiny), EngineConfig(max_batch_size=2, prefix_cache_slots=1))
    alone = GenerationRequest(prompt=SYSTEM + "Name a tree.", adapter_names=("g",), adapter_weights=(1.0,),
                              sampling=SamplingParams(max_tokens=1, temperature=0))
    engine.generate([alone])
    engine.generate([routed("Name a colour.", [], a=0.3)])  # its routing pass replaced `alone` (shared prefix)
    engine.generate([alone])
    assert engine.prefixes.hits == 2  # the routing pass, then `alone`: the exact pass kept nothing
    assert [e.own for e in engine.prefixes._entries.values()] == [False]


def test_a_routing_pass_pooling_the_mean_computes_every_token(engines: tuple[Engine, Engine]) -> None:
    cached, plain = engines
    seen: list[torch.Tensor] = []
    reference: list[torch.Tensor] = []
    for _ in range(2):
        cached.generate([routed("Name a fruit.", seen, "mean")])
    plain.generate([routed("Name a fruit.", reference, "mean")])
    assert cached.prefixes.hits == 1  # the repeat's exact pass only: the mean needs every position's state
    torch.testing.assert_close(seen[1], reference[0], atol=1e-5, rtol=1e-5)


def test_negative_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix_cache_slots"):
        EngineConfig(prefix_cache_slots=-1)


@pytest.mark.parametrize(("option", "field", "default"), [("--prefix-cache-slots", "prefix_cache_slots", 4),
                                                       ("--route-state-cache", "route_state_cache", 4096)])
def test_the_server_option_reaches_the_engine(monkeypatch: pytest.MonkeyPatch, option: str, field: str,
                                              default: int) -> None:
    import argparse

    from serving.cli import add_serve_arguments, settings_from_args
    from serving.stack import stack_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    assert getattr(stack_config(settings_from_args(parser.parse_args(["serve"]))).engine, field) == default
    given = settings_from_args(parser.parse_args(["serve", option, "0"]))
    assert getattr(stack_config(given).engine, field) == 0
    monkeypatch.setenv(f"FEDMOSAIC_SERVE_{field.upper()}", "-2")
    with pytest.raises(SystemExit, match=field):
        settings_from_args(parser.parse_args(["serve"]))
