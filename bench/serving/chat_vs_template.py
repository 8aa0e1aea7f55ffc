"""Chat against the trained template on a served run: ROUGE-1 per task through both OpenAI endpoints.

Serves a training run (``python -m fedmosaic.cli serve RUN``, this checkout; default ``runs/quickstart``,
which ``fedmosaic quickstart`` trains) and sends the first ``--limit`` test examples of each task to the
task's client (``<client>``: FedDPA's personalised model; ``--target global`` for the global adapter),
greedy, three ways:

  template      ``/v1/completions`` with the prompt training rendered (the run's ``train.prompt_style``,
                ``training.data.prompts``), as ``fedmosaic eval`` sends it
  chat          ``/v1/chat/completions`` with the record as chat messages (its input as the system
                message, its instruction as the user's; a chat-style run: one user message), as a chat
                client sends it; the server renders them in the run's template (``serving.openai.chat_format``)
  chat_template ``/v1/completions`` with the base model's chat template around the same user message:
                what the chat endpoint rendered before it knew the run's template (only for runs not
                trained on the chat template)

Scores each with the project's ROUGE-1 (``training.scoring``) and prints one JSON object: per task and
overall, the three figures, chat's gap to template relative to template, and how many chat answers equal
the template answers. The target: chat within 5 % (relative) of template.
Usage: python -m bench.serving.chat_vs_template [--run runs/quickstart] [--limit 10] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.serving.common import print_json, served
from models.settings import DTYPES
from training.data import Record, load_run_dataset
from training.data.prompts import PromptConfig, format_prompt, user_text
from training.scoring import score

WAYS = ("template", "chat", "chat_template")


@contextmanager
def server(args: argparse.Namespace, log: Path) -> Iterator[str]:
    """``fedmosaic serve RUN`` (this checkout) on a free port until the block ends; yields its URL."""
    serve_args = [str(args.run), *(["--dtype", args.dtype] if args.dtype else []),
                  *(["--device", args.device] if args.device else [])]
    with served(serve_args, log, threads=args.threads, ready_s=900) as url:
        yield url


def tokenizer_of(model: str) -> Any:
    """The run's base-model tokenizer (for its chat template), without loading the model."""
    if model == "tiny":
        from models import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    from models.prepare import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


def messages(record: Record, style: str) -> list[dict[str, str]]:
    """The record as a chat client sends it: input as the system message (a chat-style run: one user turn)."""
    if style == "chat" or not record.input.strip():
        return [{"role": "user", "content": user_text(record) if style == "chat" else record.instruction}]
    return [{"role": "system", "content": record.input}, {"role": "user", "content": record.instruction}]


def bodies(record: Record, style: str, tokenizer: Any, target: str, max_tokens: int
           ) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each way's endpoint and request body for ``record``."""
    common = {"model": target, "max_tokens": max_tokens, "temperature": 0}
    out = {"template": ("/v1/completions", {**common, "prompt": format_prompt(record, tokenizer,
                                                                                PromptConfig.named(style))}),
           "chat": ("/v1/chat/completions", {**common, "messages": messages(record, style)})}
    if style != "chat":
        around = tokenizer.apply_chat_template([{"role": "user", "content": user_text(record)}], tokenize=False,
                                               add_generation_prompt=True)
        out["chat_template"] = ("/v1/completions", {**common, "prompt": str(around)})
    return out


async def answer(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The answer's text and its ``fedmosaic`` field."""
    response = await client.post(path, json=body)
    response.raise_for_status()
    reply = response.json()
    choice = reply["choices"][0]
    return (choice["message"]["content"] if "message" in choice else choice["text"]), reply.get("fedmosaic") or {}


async def collect(url: str, jobs: list[tuple[str, Record, dict[str, tuple[str, dict[str, Any]]]]], concurrency: int
                  ) -> list[dict[str, tuple[str, dict[str, Any]]]]:
    """Every job's answers, each way of one example sent one after another, ``concurrency`` examples at once."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:

        async def one(ways: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, tuple[str, dict[str, Any]]]:
            async with gate:
                return {way: await answer(client, path, body) for way, (path, body) in ways.items()}

        return list(await asyncio.gather(*(one(ways) for _, _, ways in jobs)))


def figures(jobs: list[tuple[str, Record, Any]], answers: list[dict[str, tuple[str, dict[str, Any]]]]
            ) -> dict[str, Any]:
    """ROUGE-1 per task and way, overall (the mean over examples), chat's relative gap, equal answers."""
    tasks: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(t for t, _, _ in jobs):
        rows = [(r, a) for (t, r, _), a in zip(jobs, answers, strict=True) if t == task]
        refs = [r.output for r, _ in rows]
        tasks[task] = {w: round(score([a[w][0] for _, a in rows], refs).rouge1, 2) for w in WAYS if w in rows[0][1]}
        tasks[task]["n"] = len(rows)
        tasks[task]["equal_answers"] = sum(a["chat"][0] == a["template"][0] for _, a in rows)
    refs = [r.output for _, r, _ in jobs]
    overall: dict[str, Any] = {w: round(score([a[w][0] for a in answers], refs).rouge1, 2)
                               for w in WAYS if w in answers[0]}
    overall["n"] = len(jobs)
    overall["equal_answers"] = sum(a["chat"][0] == a["template"][0] for a in answers)
    for row in [*tasks.values(), overall]:
        gap = (row["chat"] - row["template"]) / row["template"] if row["template"] else None
        row["chat_vs_template"] = round(gap, 4) if gap is not None else None
    gap = overall["chat_vs_template"]
    return {"tasks": tasks, "overall": overall, "within_5pct": gap is not None and abs(gap) <= 0.05}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--run", type=Path, default=Path("runs/quickstart"), help="the run directory to serve")
    p.add_argument("--limit", type=int, default=10, help="test examples per task (the first ones)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per answer")
    p.add_argument("--target", choices=["client", "global"], default="client",
                   help="client: each task's <client> (FedDPA's personalised model); global: the global adapter")
    p.add_argument("--concurrency", type=int, default=8, help="examples in flight (continuous batching)")
    p.add_argument("--url", default=None, help="a server already serving the run (default: start one)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="the server's dtype (default: its own)")
    p.add_argument("--device", default=None, help="the server's device (default: FEDMOSAIC_DEVICE, else auto)")
    p.add_argument("--threads", type=int, default=None, help="the server's OMP_NUM_THREADS")
    args = p.parse_args()
    cfg = json.loads((args.run / "run.json").read_text())
    style = str((cfg.get("train") or {}).get("prompt_style", "alpaca_short"))
    dataset = load_run_dataset(cfg, run_dir=args.run)
    tokenizer = tokenizer_of(str(cfg.get("model", "smollm2")))
    jobs = []
    for client in dataset.client_ids:
        task = dataset.task_of(client)
        target = client if args.target == "client" else "global"
        jobs += [(task, r, bodies(r, style, tokenizer, target, args.max_tokens))
                 for r in list(dataset.tests.get(task, ()))[: args.limit]]
    if not jobs:
        raise SystemExit(f"{args.run}: its data set has no test examples")
    t0 = time.perf_counter()
    log = Path(tempfile.mkstemp(prefix="chat-vs-template-", suffix=".log")[1])  # the server's output
    if args.url:
        answers = asyncio.run(collect(args.url, jobs, args.concurrency))
    else:
        with server(args, log) as url:
            answers = asyncio.run(collect(url, jobs, args.concurrency))
    formats = sorted({a["chat"][1].get("prompt_format", "") for a in answers})
    print_json({"run": str(args.run), "prompt_style": style, "target": args.target, "limit": args.limit,
                "max_tokens": args.max_tokens, "chat_prompt_format": formats, **figures(jobs, answers),
                "seconds": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
