"""The offline batch runner: an OpenAI batch file (JSONL) through the engine, no HTTP.

Input: one request per line, in the OpenAI / vLLM batch-file format
``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}``
or a bare request body (chat when it has ``messages``, completion when it has ``prompt``; its
custom_id is ``line-<n>``). Bodies are validated by the HTTP API's own models and answered by its own
builders (:mod:`serving.openai.schemas`, :mod:`serving.openai.builders`), so a line gets the response body
the server would send, ``fedmosaic`` extension field included (with the FedDPA routing details: the
batch runner is the operator's own tool). A line asking for several choices (``n``, a batch of
prompts) runs them all and is answered once the last one finished.

Output: the OpenAI batch output format, one line per request, in input order:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. A bad line (invalid
UTF-8, invalid JSON, JSON nested deeper than ``MAX_DEPTH``, unknown url, invalid body, unknown model)
gets its status and the OpenAI error envelope as the body, with the inner error object in ``error``; it
never stops the rest of the file: the input is decoded line by line. ``fedmosaic batch`` exits with
status 1 when any line failed (the summary says how many), 0 when every line was answered.

Every valid request is handed to the engine at once (a window in flight), so continuous batching
mixes clients across the whole file. Finished lines are appended to ``<output>.partial`` as they
finish; the output itself is written atomically (temporary file + rename) at the end. A rerun skips
the custom_ids already answered successfully in the output or the partial file, so an interrupted run
resumes where it stopped; failed lines are tried again (a fixed line, or a transient 429/503, then
succeeds; a still-bad line costs no generation).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from serving.openai import builders, compat
from serving.openai.builders import Choice, Limits
from serving.openai.compat import FieldPolicy, SamplingDefaults
from serving.openai.errors import error_payload, validation_payload
from serving.openai.responses import Answer, ChatShape, CompletionShape, best_of
from serving.openai.schemas import ChatCompletionRequest, CompletionRequest
from serving.stack import Job, JobOutcome

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_DEPTH = 32  # lists and objects nested in one line; a chat line with content parts nests about 7
MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}


# (model, mixture) -> the trained template a chat request to it is rendered in, None for the chat template
TrainedStyles = Callable[[str, list[tuple[str, float]] | None], str | None]


class Executor(Protocol):
    """What runs the requests: :class:`serving.stack.ServingStack` or the optional vLLM backend."""

    def run(self, jobs: Iterable[Job], window: int | None = None) -> Iterator[JobOutcome]: ...


@dataclass(frozen=True)
class BatchConfig:
    """Limits applied to every line, as the HTTP server applies them.

    Attributes:
        max_tokens_limit: the largest ``max_tokens`` a line may ask for.
        default_max_tokens: ``max_tokens`` of a chat line that sets none.
        window: requests in flight at most (None: the executor's default).
        max_choices: choices one line may ask for (prompts x n).
        exact_prefill: a ``<client>`` prompt with instance-wise weights is prefilled again with its routed
            weights (False: the routing pass's cache is kept; ``--feddpa-prefill once``).
        defaults: the model's sampling defaults for fields a line leaves unset (``--generation-config``).
    """

    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    window: int | None = None
    max_choices: int = 64
    exact_prefill: bool = True
    defaults: SamplingDefaults = SamplingDefaults()

    def limits(self) -> Limits:
        """The request limits every line gets."""
        return Limits(self.max_tokens_limit, self.default_max_tokens, self.max_choices, self.defaults)


@dataclass(frozen=True)
class BatchSummary:
    """What a run did."""

    lines: int
    skipped: int
    succeeded: int
    failed: int
    output: str


@dataclass(frozen=True)
class Line:
    """One input line: its body validated, or the error it gets."""

    n: int
    custom_id: str
    url: str = CHAT
    body: ChatCompletionRequest | CompletionRequest | None = None
    error: tuple[int, dict[str, Any]] | None = None


def _fail(status: int, message: str, code: str = "invalid_request", param: str | None = None,
          type_: str = "BadRequestError") -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _depth(value: object) -> int:
    """How deeply lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in children)
    return deepest


def parse_line(n: int, text: str | bytes) -> Line:
    """Parse input line ``n`` (1-based; text, or the raw bytes of the file) into a validated request or an error."""
    fallback = f"line-{n}"
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Line(n, fallback, error=_fail(400, f"line {n} is not UTF-8 text ({exc.reason} at byte {exc.start})"))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(n, fallback, error=_fail(400, f"line {n} is not valid JSON: {exc}"))
    except RecursionError:  # far deeper than MAX_DEPTH
        return Line(n, fallback, error=_fail(400, f"line {n} nests lists and objects deeper than {MAX_DEPTH} levels"))
    if _depth(obj) > MAX_DEPTH:
        return Line(n, fallback, error=_fail(400, f"line {n} nests lists and objects deeper than {MAX_DEPTH} levels"))
    if not isinstance(obj, dict):
        return Line(n, fallback, error=_fail(400, f"line {n} must be a JSON object"))
    if "body" in obj:
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return Line(n, fallback, error=_fail(400, f"line {n}: custom_id must be a non-empty string",
                                                 param="custom_id"))
        url, method = obj.get("url", CHAT), str(obj.get("method", "POST")).upper()
        body = obj["body"]
        if method != "POST":
            return Line(n, custom_id, error=_fail(405, f"method {method} is not supported; use POST",
                                                  "method_not_allowed", "method", "MethodNotAllowed"))
        if url not in MODELS:
            return Line(n, custom_id, error=_fail(404, f"url {url!r} is not supported; use {CHAT} or {COMPLETIONS}",
                                                  "not_found", "url", "NotFoundError"))
    else:
        custom_id, body = fallback, obj
        url = CHAT if "messages" in obj else COMPLETIONS if "prompt" in obj else ""
        if not url:
            return Line(n, custom_id, error=_fail(400, f"line {n}: a bare request body needs 'messages' (chat) "
                                                      "or 'prompt' (completions)"))
    if not isinstance(body, dict):
        return Line(n, custom_id, url, error=_fail(400, f"line {n}: body must be a JSON object", param="body"))
    try:
        return Line(n, custom_id, url, MODELS[url].model_validate(body))
    except ValidationError as exc:
        return Line(n, custom_id, url, error=(400, validation_payload(exc.errors())))


def read_done(*paths: Path) -> dict[str, dict[str, Any]]:
    """Successful output lines by custom_id from earlier runs (failures and torn lines left out)."""
    done: dict[str, dict[str, Any]] = {}
    for path in paths:
        if not path.is_file():
            continue
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(raw)
                status = int(row["response"]["status_code"])
                custom_id = row["custom_id"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if isinstance(custom_id, str) and status == 200:
                done[custom_id] = row
    return done


def output_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of the OpenAI batch output format."""
    error = body.get("error") if status != 200 else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": error}


def _jobs(line: Line, tokenizer: PreTrainedTokenizerBase, config: BatchConfig,
          styles: TrainedStyles | None = None) -> list[tuple[Choice, Job]]:
    """The engine jobs of a valid line, one per choice (raises InvalidRequest on template or limit errors)."""
    body = line.body
    assert body is not None
    mixture = body.mixture()
    style = styles(body.model, mixture) if styles is not None and isinstance(body, ChatCompletionRequest) else None
    return [(c, Job(target=body.model, sampling=c.sampling, prompt=c.prompt, prompt_ids=c.prompt_ids,
                    mixture=tuple(mixture) if mixture else None, key=(line.n, i), exact_prefill=config.exact_prefill))
            for i, c in enumerate(builders.choices(body, tokenizer, config.limits(), style))]


def _answer(line: Line, tokenizer: PreTrainedTokenizerBase, choices: list[Choice], outcomes: list[JobOutcome],
            created: int) -> tuple[int, dict[str, Any]]:
    body = line.body
    assert body is not None
    failed = next((o.error for o in outcomes if o.error is not None), None)
    if failed is not None:
        return error_payload(failed)
    answers = []
    for choice, outcome in zip(choices, outcomes, strict=True):
        assert outcome.result is not None and outcome.plan is not None
        answers.append(Answer(choice, outcome.plan, outcome.result))
    try:
        if isinstance(body, ChatCompletionRequest):
            k = (body.top_logprobs or 0) if body.logprobs else None
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": created, "model": body.model}
            return 200, ChatShape(tokenizer, head, True, k).body(answers)
        assert isinstance(body, CompletionRequest)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": created, "model": body.model}
        if compat.picks_best(body):  # best_of: the n candidates of highest cumulative log-probability
            answers = best_of(answers, body.n or 1, compat.candidates(body))
        return 200, CompletionShape(tokenizer, head, True, body.logprobs).body(answers)
    except Exception as exc:  # an engine error or cancellation of this line only
        logger.error("line %d (%s) failed: %s", line.n, line.custom_id, exc)
        return error_payload(exc)


def run_batch(executor: Executor, tokenizer: PreTrainedTokenizerBase, input_path: str | Path, output_path: str | Path,
              config: BatchConfig = BatchConfig(), progress: bool = True, styles: TrainedStyles | None = None
              ) -> BatchSummary:
    """Answer every line of ``input_path`` into ``output_path`` (see the module docstring).

    Args:
        executor: runs the jobs (the serving stack, or the vLLM backend).
        tokenizer: applies the chat template to chat lines.
        input_path: the batch file.
        output_path: the results file (written atomically; ``<output>.partial`` while running).
        config: token limits and the in-flight window.
        progress: show a progress bar.
        styles: the trained template of a chat line's target (``(model, mixture) -> style``, None for the
            chat template; :func:`serving.openai.chat_format.trained_style` over the stack), as the server
            renders it; None: every chat line gets the chat template.
    """
    from tqdm.auto import tqdm

    out = Path(output_path)
    partial = out.with_name(out.name + ".partial")
    done = read_done(out, partial)
    # decoded line by line: one line that is not UTF-8 is that line's error, not the file's
    lines = [parse_line(n, raw) for n, raw in enumerate(Path(input_path).read_bytes().splitlines(), 1)
             if raw.strip()]
    results: dict[int, dict[str, Any]] = {}
    seen: set[str] = set()
    todo: list[Line] = []
    skipped = 0
    for line in lines:
        if line.custom_id in seen:
            results[line.n] = output_line(line.custom_id, *_fail(
                400, f"line {line.n}: duplicate custom_id {line.custom_id!r}", param="custom_id"))
        elif line.custom_id in done:
            results[line.n] = done[line.custom_id]
            skipped += 1
        else:
            todo.append(line)
        seen.add(line.custom_id)
    created = int(time.time())
    out.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("a", encoding="utf-8") as sink, \
            tqdm(total=len(todo), desc="batch", unit="req", disable=not progress) as bar:

        def record(line: Line, status: int, body: dict[str, Any]) -> None:
            row = output_line(line.custom_id, status, body)
            results[line.n] = row
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            bar.update(1)

        jobs: list[Job] = []
        by_n: dict[int, tuple[Line, list[Choice]]] = {}
        fields = FieldPolicy()  # unknown fields: one warning per name, as the server
        for line in todo:
            if line.error is not None:
                record(line, *line.error)
                continue
            assert line.body is not None
            fields.check(line.body)
            try:
                pairs = _jobs(line, tokenizer, config, styles)
            except Exception as exc:  # template or limit errors of this line only
                record(line, *error_payload(exc))
                continue
            jobs += [job for _, job in pairs]
            by_n[line.n] = (line, [choice for choice, _ in pairs])
        arrived: dict[int, dict[int, JobOutcome]] = {}
        for outcome in executor.run(jobs, config.window):
            n, i = outcome.job.key
            line, choices = by_n[n]
            arrived.setdefault(n, {})[i] = outcome
            if len(arrived[n]) == len(choices):  # every choice of the line finished
                got = arrived.pop(n)
                record(line, *_answer(line, tokenizer, choices, [got[j] for j in range(len(choices))], created))
    ordered = [results[line.n] for line in lines]
    extra = [row for cid, row in done.items() if cid not in seen]  # answered before, no longer in the input
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in [*ordered, *extra]), encoding="utf-8")
    os.replace(tmp, out)
    partial.unlink(missing_ok=True)
    failed = sum(1 for row in ordered if row["response"]["status_code"] != 200)
    return BatchSummary(lines=len(lines), skipped=skipped, succeeded=len(ordered) - failed, failed=failed,
                        output=str(out))
