"""Grammar-constrained decoding inside the batched engine (tiny model, float32).

The mask a matcher writes equals the tokens its grammar accepts (a naive loop asking a fresh matcher
about every token of the vocabulary); the engine's constrained greedy rows equal a naive loop of full
forwards taking the argmax over the allowed tokens, and end where the grammar ends; unconstrained rows
in the same batch get the token ids they get alone; each choice of ``n`` and each adapter path (a mixture,
a routed ``weight_fn``) decodes valid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest
import torch

from models import LoadedModel
from models.tiny import tiny_tokenizer
from serving.engine import Engine
from serving.engine.grammar import Grammar, GrammarCompiler, apply_masks, unpack
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.errors import InvalidRequest
from tests.serving.helpers import adapted_with

SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["colour", "ok", "n"], "additionalProperties": False}
PROMPTS = ("The capital of France is", "Sort these words: pear apple", "Convert 5 km to miles")
MIX = (("g", "l1"), (0.6, 0.4))


@pytest.fixture(scope="module")
def grammar() -> Grammar:
    return GrammarCompiler(tiny_tokenizer()).json_schema(SCHEMA, "JSON schema 'answer'")


def allowed_naive(grammar: Grammar, prefix: Sequence[int], vocab: int) -> set[int]:
    """Every token a fresh matcher, advanced past ``prefix``, accepts next."""
    out = set()
    for t in range(vocab):
        matcher = grammar.matcher()
        for p in prefix:
            matcher.accept(p)
        try:
            matcher.accept(t)
        except InvalidRequest:
            continue
        out.add(t)
    return out


def test_unpack_reads_every_bit_as_a_naive_loop() -> None:
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    packed = words.to(torch.int32)
    got = unpack(packed, 150)  # fewer tokens than bits: the rest cut; and more below
    for r in range(3):
        for t in range(150):
            assert bool(got[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1), (r, t)
    assert unpack(packed, 170)[:, 160:].any().item() is False  # past the mask: disallowed


def test_the_mask_is_what_the_grammar_accepts(tiny: LoadedModel, grammar: Grammar) -> None:
    vocab = tiny.model.config.vocab_size
    text = tiny.tokenizer('{"colour": "re', add_special_tokens=False)["input_ids"]
    for prefix in ([], text[:1], text):
        matchers = [None, grammar.matcher(), None]
        for t in prefix:
            matchers[1].accept(t)  # type: ignore[union-attr]
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(len(prefix)))
        out = apply_masks(logits, matchers)  # type: ignore[arg-type]
        want = allowed_naive(grammar, prefix, vocab)
        assert want and set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == want
        assert torch.equal(out[1][list(want)], logits[1][list(want)])
        assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert apply_masks(logits, [None, None, None]) is logits


def naive_constrained(engine: Engine, grammar: Grammar, prompt: str, n: int) -> list[int]:
    """Greedy over full forwards (the request's adapter mixture), the argmax over the allowed tokens."""
    ids = list(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    matcher, out = grammar.matcher(), []
    for _ in range(n):
        with torch.inference_mode(), engine.adapted.context.use(MIX[0], torch.tensor([MIX[1]])):  # type: ignore[union-attr]
            logits = engine.model(input_ids=torch.tensor([ids + out])).logits[0, -1:].float()
        token = int(apply_masks(logits, [matcher])[0].argmax())
        matcher.accept(token)
        out.append(token)
        if matcher.done:
            break
    return out


def request(prompt: str, grammar: Grammar | None, **sampling: Any) -> GenerationRequest:
    params = SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **sampling}, grammar=grammar)
    return GenerationRequest(prompt=prompt, sampling=params, adapter_names=MIX[0], adapter_weights=MIX[1])


def test_a_mixed_batch_constrains_its_grammar_rows_only(tiny: LoadedModel, grammar: Grammar) -> None:
    engine = Engine(tiny, adapted_with(tiny))
    alone = [engine.generate([request(p, None, ignore_eos=True, max_tokens=12)])[0].token_ids for p in PROMPTS]
    batch = [request(p, grammar if i % 2 else None, ignore_eos=i % 2 == 0, max_tokens=12 if i % 2 == 0 else 40)
             for i, p in enumerate(p for p in PROMPTS for _ in range(2))]
    results = engine.generate(batch)
    for i, result in enumerate(results):
        prompt = PROMPTS[i // 2]
        if i % 2 == 0:
            assert result.token_ids == alone[i // 2]  # untouched by the constrained rows beside it
            continue
        assert list(result.token_ids) == naive_constrained(engine, grammar, prompt, 40)
        assert result.finish_reason == "stop" and result.token_ids[-1] in engine.lifecycle.eos_ids
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_sampled_choices_each_follow_their_own_matcher(tiny: LoadedModel, grammar: Grammar) -> None:
    engine = Engine(tiny, adapted_with(tiny))
    results = engine.generate([request(PROMPTS[0], grammar, temperature=1.0, seed=s, top_p=0.9, max_tokens=80)
                               for s in range(4)])
    for result in results:
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), SCHEMA)
    assert len({r.text for r in results}) > 1  # four rows, four matchers: not one shared state


def test_a_routed_request_decodes_under_its_grammar(tiny: LoadedModel, grammar: Grammar) -> None:
    engine = Engine(tiny, adapted_with(tiny))

    def route(state: torch.Tensor, ids: Sequence[int]) -> tuple[list[float], dict[str, Any]]:
        return [0.3, 0.7], {"a": 0.7}

    for exact in (False, True):
        req = GenerationRequest(prompt=PROMPTS[1], sampling=SamplingParams(max_tokens=40, temperature=0.0,
                                grammar=grammar), adapter_names=MIX[0], adapter_weights=MIX[1], weight_fn=route,
                                prefill_weights=(1.0, 0.0), exact_prefill=exact)
        result = engine.generate([req])[0]
        assert result.adapter_weights == (0.3, 0.7) and result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_a_token_the_grammar_refuses_fails_its_row_only(tiny: LoadedModel, grammar: Grammar) -> None:
    matcher = grammar.matcher()
    with pytest.raises(InvalidRequest, match="breaks the request's JSON schema 'answer'"):
        matcher.accept(int(tiny.tokenizer("x", add_special_tokens=False)["input_ids"][0]))
