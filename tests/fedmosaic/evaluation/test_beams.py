"""``fedmosaic eval --num-beams``: the evaluator's answers equal a naive greedy / beam search on the tiny model.

The reference runs the model on the whole sequence at every step (no cache, no padding, one prompt at
a time) with the same adapter weights the backend reports for the answer, keeps the ``num_beams``
highest summed log-probabilities over every (beam, token) extension, and returns the best beam. With 1
beam that is greedy decoding (the engine's path); with 4, the reference code's beam search (HF
``generate``). The prompts are chosen so that no beam meets EOS, where HF's finished-hypothesis rules
would also apply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters import inject, load_adapter
from fedmosaic.evaluation.backend import EvalItem
from fedmosaic.evaluation.evaluate import EvalOptions, evaluate_run
from fedmosaic.evaluation.stack_backend import open_backend
from models import tiny_llama
from tests.fedmosaic.evaluation.test_evaluate import build_run

PROMPTS = ["Sort: pear, apple, fig", "Capital of Peru?", "twelve plus seven"]
TOKENS = 5


def naive_beam_search(run_root: Path, prompt: str, weights: dict[str, float], client: str, beams: int) -> str:
    """The best of ``beams`` beams after ``TOKENS`` steps, by summed log-probability, recomputed from scratch."""
    tiny = tiny_llama()
    adapted = inject(tiny.model)
    load_adapter(adapted, run_root / "adapters" / "global", "global", check_base=False)
    load_adapter(adapted, run_root / "adapters" / "clients" / client / "local", "local", check_base=False)
    w = torch.tensor([[weights["global"], weights[f"{client}:local"]]])  # (1, 2)
    ids = tiny.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    alive: list[tuple[float, list[int]]] = [(0.0, [])]
    with torch.inference_mode(), adapted.context.use(("global", "local"), w):
        for _ in range(TOKENS):
            candidates = []
            for score, seq in alive:
                logits = tiny.model(input_ids=torch.tensor([ids + seq])).logits[0, -1]  # type: ignore[operator]
                logp = torch.log_softmax(logits.double(), dim=-1)
                top = torch.topk(logp, 2 * beams)
                candidates += [(score + float(v), [*seq, int(t)]) for v, t in zip(top.values, top.indices, strict=True)]
            alive = sorted(candidates, key=lambda c: -c[0])[:beams]
            assert all(s[-1] != tiny.tokenizer.eos_token_id for _, s in alive)  # type: ignore[attr-defined]
    return tiny.tokenizer.decode(alive[0][1], skip_special_tokens=True).strip()  # type: ignore[attr-defined]


@pytest.mark.parametrize("beams", [1, 4])
def test_backend_answers_equal_the_naive_search(tmp_path: Path, beams: int) -> None:
    run = build_run(tmp_path, embeddings=True)  # FedDPA-T: routed (instance-wise) weights per prompt
    backend = open_backend(run, run.read_config(), dtype="float32", max_new_tokens=TOKENS, num_beams=beams,
                           batch_size=2, mode="knn")
    assert backend.describe("sorting")["decoding"] == ("greedy" if beams == 1 else "beams=4")
    items = [EvalItem("final", "sorting", "t", i, "sorting", p, "", "") for i, p in enumerate(PROMPTS)]
    answers = {item.i: pred for item, pred in backend.generate(items)}
    weights = [answers[i].extra["weights"] for i in range(len(PROMPTS))]
    assert len({round(w["sorting:local"], 6) for w in weights}) > 1  # routed: a differs per prompt
    for i, prompt in enumerate(PROMPTS):
        assert answers[i].text == naive_beam_search(run.root, prompt, weights[i], "sorting", beams)


def test_the_prediction_cache_keys_on_beams_and_tokens(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    first = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, num_beams=2, dtype="float32"))
    path = run.eval_dir / "predictions" / "final" / "sorting" / "capitals.jsonl"
    assert json.loads(path.read_text().splitlines()[-1])["tag"].count('"decoding": "beams=2"') == 1
    again = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, num_beams=2, dtype="float32"))
    assert again["scores"] == first["scores"] and len(path.read_text().splitlines()) == 1  # reused, not redone
    for opts in (EvalOptions(limit=1, max_new_tokens=2, dtype="float32"),  # greedy: redone
                 EvalOptions(limit=1, max_new_tokens=3, num_beams=2, dtype="float32")):  # longer: redone
        evaluate_run(run.root, opts)
    tags = [json.loads(line)["tag"] for line in path.read_text().splitlines()]
    assert len(tags) == 3 and len(set(tags)) == 3
    assert evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, num_beams=2, dtype="float32"))[
        "scores"] == first["scores"]
    assert len(path.read_text().splitlines()) == 3  # back to the first setting: its rows are reused, not redone
