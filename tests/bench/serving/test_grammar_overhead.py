"""``bench.serving.grammar_overhead`` runs on the tiny model: every grammar engine walks the valid answer
(each asserts it accepts every token), and the engine decodes constrained and unconstrained rows."""

from __future__ import annotations

from bench.serving import grammar_overhead as bench
from models import tiny_llama


def test_the_grammar_overhead_benchmark_runs() -> None:
    out = bench.measure(tiny_llama(), rounds=1, tokens=3)
    assert set(out["grammar_engines"]) == {"xgrammar", "llguidance", "outlines_core"}
    assert all(e["per_token_us"] > 0 and e["compile_s"] >= 0 for e in out["grammar_engines"].values())
    assert set(out["engine_decode_tok_s"]) == {"unconstrained_b1", "constrained_b1", "unconstrained_b8",
                                               "constrained_b8"}
    assert set(out["constrained_over_unconstrained"]) == {"batch_1", "batch_8"}
