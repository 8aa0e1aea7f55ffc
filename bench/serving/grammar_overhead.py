"""What grammar-constrained decoding costs: three grammar engines' per-token mask, and the engine's decode.

Part 1, the grammar engines on the model's vocabulary (SmolLM2's 49,152 tokens by default) for one JSON
schema (an object with an enum, a bounded integer, a string and an array of objects): each engine
compiles the schema (``compile_s``, once per schema; a fresh compiler each round, xgrammar's cache off),
then walks a valid answer token by token, filling the next-token bitmask and advancing past the token
(``per_token_us``: the cost a constrained row adds to every decode step on the host). Engines:
xgrammar (``GrammarMatcher``), llguidance (``LLMatcher``) and outlines-core (``Index`` + ``Guide``,
its regex of the schema). Cases interleaved round by round; medians.

Part 2, our engine (``serving.engine``) decoding ``--tokens`` tokens a row at batch 1 and 8, every row
unconstrained or every row under xgrammar's grammar of an array of such objects (at least 50 of them,
so no row ends before ``--tokens``): decode tokens/s (the time of ``--tokens`` tokens minus the time of
one, so prefill is left out; fresh prompts each call) and the constrained / unconstrained ratio; and
what masking alone adds to a step of 1 and 8 constrained rows (``mask_step_us``: the matchers' bitmasks
filled, moved to the model's device, applied to the logits), which a loaded shared machine cannot hide
the way it hides a small difference of whole decodes.

Prints one JSON object. Usage: python -m bench.serving.grammar_overhead [--model smollm2|tiny] [--rounds 3]
[--tokens 48] [--device cpu|cuda] [--dtype ...] [--threads 2] [--skip-engine]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.serving.common import apply_threads, interleave, median, parser, print_json, prompts, ratio
from models import LoadedModel, load_base_model, tiny_llama
from serving.engine import Engine
from serving.engine.grammar import Grammar, GrammarCompiler, apply_masks
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams

ITEM: dict[str, Any] = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral"]}, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string", "maxLength": 80}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["label", "stars", "summary", "tags"], "additionalProperties": False}
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"reviews": {"type": "array", "items": ITEM}},
                          "required": ["reviews"], "additionalProperties": False}
LONG: dict[str, Any] = {"type": "array", "items": ITEM, "minItems": 50}
ANSWER = {"reviews": [{"label": "positive", "stars": 5, "summary": "Great food and friendly staff, would go again.",
                       "tags": ["food", "service"]},
                      {"label": "negative", "stars": 2, "summary": "Cold soup.", "tags": ["food", "temperature"]}]}


def answer_ids(loaded: LoadedModel) -> list[int]:
    """The valid answer in the grammars' compact form (``", "`` and ``": "``), as token ids."""
    return list(loaded.tokenizer(json.dumps(ANSWER), add_special_tokens=False)["input_ids"])


def xgrammar_case(loaded: LoadedModel, ids: list[int]) -> tuple[Callable[[], float], Callable[[], float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(loaded.tokenizer, vocab_size=len(loaded.tokenizer))

    def compile_s() -> float:
        t0 = time.perf_counter()
        xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        return time.perf_counter() - t0

    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def per_token() -> float:
        matcher = xgr.GrammarMatcher(compiled)
        t0 = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(t)
        return (time.perf_counter() - t0) / len(ids) * 1e6

    return compile_s, per_token


def llguidance_case(loaded: LoadedModel, ids: list[int]) -> tuple[Callable[[], float], Callable[[], float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    vocab = llguidance.hf.from_tokenizer(loaded.tokenizer, n_vocab=len(loaded.tokenizer))
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as xgrammar's
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), overrides=compact)

    def compile_s() -> float:
        t0 = time.perf_counter()
        llguidance.LLMatcher(vocab, grammar)
        return time.perf_counter() - t0

    mask = llguidance.torch.allocate_token_bitmask(1, len(loaded.tokenizer))

    def per_token() -> float:
        matcher = llguidance.LLMatcher(vocab, grammar)
        t0 = time.perf_counter()
        for t in ids:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(t), matcher.get_error()
        return (time.perf_counter() - t0) / len(ids) * 1e6

    return compile_s, per_token


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE map, byte -> the printable character its tokens spell it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def outlines_case(loaded: LoadedModel, ids: list[int]) -> tuple[Callable[[], float], Callable[[], float]]:
    import outlines_core

    decoder = {c: b for b, c in byte_level_alphabet().items()}  # byte-level BPE: token text -> its bytes
    eos = int(loaded.tokenizer.eos_token_id)
    tokens: dict[bytes, list[int]] = {}
    for token, i in loaded.tokenizer.get_vocab().items():
        if i != eos and i not in loaded.tokenizer.all_special_ids:
            tokens.setdefault(bytes(decoder.get(c, 0) for c in token), []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, tokens)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")

    def compile_s() -> float:
        t0 = time.perf_counter()
        outlines_core.Index(regex, vocabulary)
        return time.perf_counter() - t0

    index = outlines_core.Index(regex, vocabulary)
    mask = torch.zeros((len(loaded.tokenizer) + 31) // 32, dtype=torch.int32)

    def per_token() -> float:
        guide = outlines_core.Guide(index)
        t0 = time.perf_counter()
        for t in ids:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(t)
        return (time.perf_counter() - t0) / len(ids) * 1e6

    return compile_s, per_token


def mask_case(loaded: LoadedModel, grammar: Grammar, ids: list[int], batch: int) -> Callable[[], float]:
    """Microseconds a decode step spends masking ``batch`` constrained rows (:func:`apply_masks`: every
    matcher fills its bitmask row, the mask goes to the logits' device and masks them), matchers advanced
    along the answer between steps."""
    vocab = int(loaded.model.config.vocab_size)
    logits = torch.randn(batch, vocab, device=loaded.device)

    def per_step() -> float:
        matchers = [grammar.matcher() for _ in range(batch)]
        spent = 0.0
        for t in ids:
            t0 = time.perf_counter()
            masked = apply_masks(logits, list(matchers))
            float(masked[0, 0])  # the device's work done before the clock stops
            spent += time.perf_counter() - t0
            for m in matchers:
                m.accept(t)
        return spent / len(ids) * 1e6

    return per_step


def engine_case(engine: Engine, grammar: Grammar | None, batch: int, tokens: int, offset: list[int]
                ) -> Callable[[], float]:
    """Decode tokens/s of ``batch`` rows (fresh prompts each call), prefill and first token left out."""

    def run(n: int) -> float:
        offset[0] += batch
        texts = prompts(engine.tokenizer, batch, offset[0])
        reqs = [GenerationRequest(prompt=t, sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                                    grammar=grammar)) for t in texts]
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        assert all(len(r.token_ids) == n for r in results), [r.finish_reason for r in results]
        return time.perf_counter() - t0

    def tok_s() -> float:
        return batch * (tokens - 1) / max(run(tokens) - run(1), 1e-9)

    return tok_s


def measure(loaded: LoadedModel, rounds: int, tokens: int, engine_part: bool = True) -> dict[str, Any]:
    """Both parts' figures (see the module docstring)."""
    ids = answer_ids(loaded)
    makers = {"xgrammar": xgrammar_case, "llguidance": llguidance_case, "outlines_core": outlines_case}
    built = {name: make(loaded, ids) for name, make in makers.items()}
    compiles = interleave({n: c for n, (c, _) in built.items()}, rounds)
    per_token = interleave({n: p for n, (_, p) in built.items()}, rounds)
    out: dict[str, Any] = {"vocab": len(loaded.tokenizer), "answer_tokens": len(ids), "grammar_engines": {
        n: {"compile_s": median(compiles[n]), "per_token_us": median(per_token[n], 2)} for n in built}}
    compiled = GrammarCompiler(loaded.tokenizer)
    masks = interleave({f"batch_{b}": mask_case(loaded, compiled.json_schema(SCHEMA, "bench schema"), ids, b)
                        for b in (1, 8)}, rounds)
    out["mask_step_us"] = {n: median(v, 2) for n, v in masks.items()}
    if not engine_part:
        return out
    engine = Engine(loaded)
    grammar = compiled.json_schema(LONG, "bench schema")
    offset = [0]
    cases = {f"{kind}_b{b}": engine_case(engine, grammar if kind == "constrained" else None, b, tokens, offset)
             for b in (1, 8) for kind in ("unconstrained", "constrained")}
    engine_case(engine, grammar, 8, 4, offset)()  # warm-up: first forwards, the CPU kernels' first calls
    values = interleave(cases, rounds)
    tok_s = {n: median(v, 2) for n, v in values.items()}
    out["engine_decode_tok_s"] = tok_s
    out["constrained_over_unconstrained"] = {f"batch_{b}": ratio(tok_s[f"constrained_b{b}"],
                                                                 tok_s[f"unconstrained_b{b}"]) for b in (1, 8)}
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=48, help="decoded tokens a row in part 2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip-engine", action="store_true", help="part 1 only")
    args = p.parse_args()
    apply_threads(args)
    loaded = tiny_llama(device=args.device) if args.model == "tiny" else load_base_model(
        args.model, dtype=args.dtype, device=args.device)
    figures = measure(loaded, args.rounds, args.tokens, not args.skip_engine)
    print_json({"benchmark": "bench.serving.grammar_overhead", "model": args.model, "device": str(loaded.device),
                "threads": torch.get_num_threads(), "tokens": args.tokens, **figures})


if __name__ == "__main__":
    main()
