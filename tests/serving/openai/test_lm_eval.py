"""lm-evaluation-harness against the server: its request shapes (always), and the harness itself on two local
tasks, a generation and a multiple-choice (loglikelihood) one, when ``lm_eval`` is installed (the dev extra).

The harness's ``local-completions`` model sends prompts as token ids, and scores a choice with
``echo`` + ``logprobs=1`` + ``max_tokens=1`` (the sum of the continuation's prompt log-probabilities);
every log-likelihood it gets must equal a teacher-forced forward of the served model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from models import LoadedModel, load_base_model, save_tiny_llama
from serving.settings import ServeSettings

KEY = "sk-eval"
DOCS = [
    {"question": "Question: What is the capital of France?\nAnswer:", "choices": [" Paris", " Rome", " Lima"],
     "label": 0, "answer": " Paris"},
    {"question": "Question: Which is a fruit?\nAnswer:", "choices": [" apple", " stone", " cloud"], "label": 0,
     "answer": " apple"},
    {"question": "Question: Sort: pear, apple\nAnswer: ", "choices": ["apple, pear", "pear, apple"], "label": 0,
     "answer": "apple, pear"},
]


@dataclass(frozen=True)
class Served:
    url: str
    folder: Path
    model: LoadedModel  # the same weights, loaded here for the reference forwards


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, live_server: Callable[..., str]) -> Served:
    folder = save_tiny_llama(tmp_path_factory.mktemp("lm-eval") / "tiny")
    settings = ServeSettings(model=str(folder), served_model_name="tiny", dtype="float32", api_keys=[KEY])
    url = live_server(settings)
    return Served(url, folder, load_base_model(str(folder), dtype="float32", device="cpu"))


def encode(model: LoadedModel, text: str) -> list[int]:
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def loglikelihood(model: LoadedModel, context: str, continuation: str) -> tuple[float, bool]:
    """The reference: lm-eval's split of the pair, scored by a teacher-forced forward."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(model, context + continuation), encode(model, context)
    with torch.inference_mode():
        logp = torch.log_softmax(model.model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
    cont = range(len(ctx), len(whole))
    total = sum(float(logp[i - 1, whole[i]]) for i in cont)
    return total, all(int(torch.argmax(logp[i - 1])) == whole[i] for i in cont)


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def parse_logprobs(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4's ``LocalCompletionsAPI.parse_logprobs``, verbatim in substance."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(logprobs), all(tok == max(t.values()) for tok, t in zip(logprobs, top, strict=False))))
    return res


def test_lm_eval_request_shapes(served: Served) -> None:
    """The payloads lm-eval 0.4's local-completions and local-chat-completions send, parsed its way."""
    model = served.model
    pairs = [(d["question"], c) for d in DOCS for c in d["choices"]]
    encoded = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        ctx_text = context[:-spaces] if spaces else context
        whole, ctx = encode(model, context + continuation), encode(model, ctx_text)
        encoded.append((whole, len(ctx)))
    batch = {"model": "tiny", "prompt": [w for w, _ in encoded], "temperature": 0, "max_tokens": 1, "logprobs": 1,
             "seed": 1234, "echo": True}  # a batch of 8 (--batch_size 8): choices answered by index
    got = parse_logprobs(post(served.url, "/v1/completions", batch), [n for _, n in encoded])
    for (context, continuation), (loglik, greedy) in zip(pairs, got, strict=True):
        want, want_greedy = loglikelihood(model, context, continuation)
        assert loglik == pytest.approx(want, abs=1e-3) and greedy == want_greedy
    eos = model.tokenizer.decode([model.tokenizer.eos_token_id])  # type: ignore[attr-defined]
    generate = {"prompt": [encode(model, DOCS[0]["question"])], "model": "tiny", "max_tokens": 4, "temperature": 0,
                "stop": ["\n", eos], "seed": 1234}
    assert post(served.url, "/v1/completions", generate)["choices"][0]["index"] == 0
    chat = {"messages": [{"role": "user", "content": DOCS[0]["question"]}], "model": "tiny", "max_tokens": 4,
            "temperature": 0, "stop": ["\n", eos][:4], "seed": 1234}
    assert isinstance(post(served.url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"], str)


TASKS = {
    "fedmosaic_mc": """task: fedmosaic_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "fedmosaic_gen": """task: fedmosaic_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}


def test_the_harness_runs_a_generation_and_a_multiple_choice_task(served: Served, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the dev extra")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, text in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(text.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))
    completions = simple_evaluate(
        model="local-completions", tasks=list(TASKS), task_manager=tasks, log_samples=True,
        model_args={"model": "tiny", "base_url": f"{served.url}/v1/completions", "tokenizer": str(served.folder),
                    "tokenizer_backend": "huggingface", "max_retries": 1, "batch_size": 4})
    assert completions is not None
    model = served.model
    scored = []
    for sample in completions["samples"]["fedmosaic_mc"]:
        for args, resp in zip(sample["arguments"], sample["resps"], strict=True):
            (context, continuation), (loglik, greedy) = args[:2], resp[0]
            want, want_greedy = loglikelihood(model, context, continuation)
            assert loglik == pytest.approx(want, abs=1e-3) and greedy == want_greedy
            scored.append(continuation)
    assert scored == [c for d in DOCS for c in d["choices"]]  # every choice of every document, checked
    assert "acc,none" in completions["results"]["fedmosaic_mc"]
    answers = [s["resps"][0][0] for s in completions["samples"]["fedmosaic_gen"]]
    for doc, answer in zip(completions["samples"]["fedmosaic_gen"], answers, strict=True):
        direct = post(served.url, "/v1/completions", {"model": "tiny", "prompt": doc["doc"]["question"],
                                                       "max_tokens": 5, "temperature": 0, "stop": ["\n"]})
        assert answer == direct["choices"][0]["text"]
    chat = simple_evaluate(
        model="local-chat-completions", tasks=["fedmosaic_gen"], task_manager=tasks, log_samples=True,
        apply_chat_template=True,
        model_args={"model": "tiny", "base_url": f"{served.url}/v1/chat/completions", "max_retries": 1})
    assert chat is not None and "exact_match,none" in chat["results"]["fedmosaic_gen"]
    assert len(chat["samples"]["fedmosaic_gen"]) == len(DOCS)
