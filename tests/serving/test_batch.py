"""``fedmosaic batch`` on the tiny model: OpenAI batch format in and out, per-line errors, resume, CLI."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import pytest

from fedmosaic.cli import main
from routing.feddpa_options import FedDPAOptions
from serving.batch import BatchConfig, parse_line, run_batch
from serving.engine import EngineConfig
from serving.openai.chat_format import trained_style
from serving.settings import ServeSettings
from serving.stack import Job, JobOutcome, ServingStack, StackConfig, build_stack
from tests.serving.helpers import ready_client, write_feddpa_run

CHAT = {"model": "0", "messages": [{"role": "user", "content": "Sort: pear, apple"}], "max_tokens": 5,
        "temperature": 0}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_feddpa_run(tmp_path_factory.mktemp("batch") / "run", ("0", "1"))


@pytest.fixture(scope="module")
def stack(run_dir: Path) -> ServingStack:
    return build_stack(StackConfig(model="tiny", run_dir=run_dir, engine=EngineConfig(max_batch_size=4)))


class Counting:
    """Wraps the stack: records the jobs it was given and the largest running batch."""

    def __init__(self, stack: ServingStack) -> None:
        self.stack, self.jobs, self.max_running = stack, [], 0

    def run(self, jobs: Iterable[Job], window: int | None = None) -> Iterator[JobOutcome]:
        self.jobs = list(jobs)
        for outcome in self.stack.run(self.jobs, window):
            self.max_running = max(self.max_running, self.stack.engine.stats().running + 1)
            yield outcome


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def write_input(path: Path) -> Path:
    lines = [
        line("chat-0", CHAT),
        line("cmpl-1", {"model": "global", "prompt": "Capital of Peru", "max_tokens": 4, "temperature": 0,
                        "echo": True}, "/v1/completions"),
        json.dumps({**CHAT, "model": "1"}),  # a bare chat body -> custom_id line-3
        json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 3, "temperature": 0}),  # bare completion
        "{not json",
        line("bad-url", CHAT, "/v1/embeddings"),
        line("bad-temp", {**CHAT, "temperature": 5}),
        line("no-model", {**CHAT, "model": "nope"}),
        line("chat-0", CHAT),  # duplicate custom_id
        "",
        line("too-long", {**CHAT, "max_tokens": 999}),
        line("mix", {**CHAT, "adapters": [{"name": "global", "weight": 0.5}, {"name": "1:local", "weight": 0.5}]}),
        line("chat-2", {**CHAT, "model": "1", "messages": [{"role": "user", "content": "Capital of Chad"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_file_in_openai_format(stack: ServingStack, run_dir: Path, tmp_path: Path) -> None:
    executor = Counting(stack)
    out = tmp_path / "out.jsonl"
    summary = run_batch(executor, stack.loaded.tokenizer, write_input(tmp_path / "in.jsonl"), out,
                        BatchConfig(max_tokens_limit=64), progress=False, styles=partial(trained_style, stack))
    rows = read(out)
    ids = [r["custom_id"] for r in rows]
    assert ids == ["chat-0", "cmpl-1", "line-3", "line-4", "line-5", "bad-url", "bad-temp", "no-model", "chat-0",
                   "too-long", "mix", "chat-2"]  # input order, blank line skipped
    status = {i: r["response"]["status_code"] for i, r in enumerate(rows)}
    assert [status[i] for i in range(len(rows))] == [200, 200, 200, 200, 400, 404, 400, 404, 400, 400, 200, 200]
    assert summary.succeeded == 6 and summary.failed == 6 and summary.skipped == 0
    assert len(executor.jobs) == 7 and executor.max_running >= 2  # every valid line submitted, batched together
    for r in rows:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("batch_req_")
        if r["response"]["status_code"] == 200:
            assert r["error"] is None
        else:  # the OpenAI error envelope as the body, its error object beside it
            body = r["response"]["body"]
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
            assert r["error"] == body["error"]
    chat = rows[0]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == "0"
    assert chat["fedmosaic"]["weights"] == {"global": 0.75, "0:local": 0.25}
    assert chat["fedmosaic"]["prompt_format"] == "alpaca_short"  # the run's target: its trained template
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"]
    cmpl = rows[1]["response"]["body"]
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["text"].startswith("Capital of Peru")
    assert rows[6]["error"]["param"] == "temperature" and rows[9]["error"]["param"] == "max_tokens"
    assert "not valid JSON" in rows[4]["error"]["message"] and rows[8]["error"]["param"] == "custom_id"
    assert rows[10]["response"]["body"]["fedmosaic"]["mode"] == "mixture"
    assert not (tmp_path / "out.jsonl.partial").exists()

    # the same request over HTTP gets the same answer (the builders are shared)
    with ready_client(ServeSettings(model="tiny", run_dir=run_dir, routing_details="all")) as client:
        http = client.post("/v1/chat/completions", json=CHAT).json()
    assert http["choices"] == chat["choices"] and http["usage"] == chat["usage"]
    assert http["fedmosaic"] == chat["fedmosaic"]


def test_resume_skips_answered_custom_ids(stack: ServingStack, tmp_path: Path) -> None:
    src = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    run_batch(stack, stack.loaded.tokenizer, src, out, BatchConfig(max_tokens_limit=64), progress=False)
    first = read(out)
    # an interrupted run: the output is gone, the partial file holds two answers, one a retryable 503
    partial = tmp_path / "out.jsonl.partial"
    retry = {**first[1], "response": {**first[1]["response"], "status_code": 503}}
    partial.write_text(json.dumps(first[0]) + "\n" + json.dumps(retry) + "\n" + '{"custom_id": "line-3", "resp')
    out.unlink()
    executor = Counting(stack)
    summary = run_batch(executor, stack.loaded.tokenizer, src, out, BatchConfig(max_tokens_limit=64), progress=False)
    assert summary.skipped == 1 and len(executor.jobs) == 6  # chat-0 kept; cmpl-1 (503) and the torn line-3 redone
    again = read(out)
    assert again[0] == first[0] and [r["custom_id"] for r in again] == [r["custom_id"] for r in first]
    assert again[1]["response"]["status_code"] == 200 and not partial.exists()
    executor = Counting(stack)
    assert run_batch(executor, stack.loaded.tokenizer, src, out, BatchConfig(max_tokens_limit=64),
                     progress=False).skipped == 6
    # every valid line answered: only the failed ones are tried again (the unknown model fails before generating)
    assert [j.target for j in executor.jobs] == ["nope"]
    assert [r["response"] for r in read(out) if r["response"]["status_code"] == 200] == \
        [r["response"] for r in again if r["response"]["status_code"] == 200]


def test_parse_line_rules() -> None:
    assert parse_line(1, json.dumps({"custom_id": "a", "body": CHAT})).body is not None  # url defaults to chat
    assert parse_line(2, json.dumps({"custom_id": "", "body": CHAT})).error[0] == 400
    assert parse_line(3, json.dumps({"custom_id": "a", "method": "GET", "body": CHAT})).error[0] == 405
    assert parse_line(4, json.dumps({"model": "tiny"})).error[1]["error"]["message"].endswith(
        "'messages' (chat) or 'prompt' (completions)")
    assert parse_line(5, "[1, 2]").error[0] == 400
    assert parse_line(6, json.dumps({"custom_id": "b", "body": "text"})).error[1]["error"]["param"] == "body"


def test_batch_cli(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({**CHAT, "model": "tiny"}) + "\n" + line("x", {**CHAT, "model": "1"}) + "\n")
    out = tmp_path / "res" / "out.jsonl"
    assert main(["batch", "-i", str(src), "-o", str(out), str(run_dir), "--model", "tiny", "--backend", "torch",
                 "--no-progress", "--feddpa-routing", "fixed"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["succeeded"] == 2 and summary["backend"] == "torch"
    assert [r["response"]["status_code"] for r in read(out)] == [200, 200]
    with pytest.raises(SystemExit, match="needs the vllm package"):
        main(["batch", "-i", str(src), "-o", str(out), "--model", "tiny", "--backend", "vllm"])


def test_a_relative_run_directory_loads_from_the_working_directory(run_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # `fedmosaic eval runs/x` / `fedmosaic serve runs/x`: the run dir is also the pool's root, and a relative
    # name must not be looked up inside itself (runs/x/runs/x)
    monkeypatch.chdir(run_dir.parent)
    relative = build_stack(StackConfig(model="tiny", run_dir=Path(run_dir.name), feddpa=FedDPAOptions(routing="fixed")))
    assert {"global", "0:local", "1:local"} <= set(relative.pool.names())


def test_a_line_with_several_choices_and_logprobs_matches_http(stack: ServingStack, run_dir: Path,
                                                              tmp_path: Path) -> None:
    body = {"model": "global", "prompt": ["Sort: pear, apple", "Capital of Peru?"], "n": 2, "max_tokens": 3,
            "temperature": 0, "logprobs": 1, "echo": True}
    src = tmp_path / "in.jsonl"
    src.write_text(line("multi", body, "/v1/completions") + "\n")
    run_batch(stack, stack.loaded.tokenizer, src, tmp_path / "out.jsonl", progress=False)
    got = json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]
    assert "choices" in got, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    with ready_client(ServeSettings(model="tiny", run_dir=run_dir, routing_details="all")) as client:
        http = client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in http["choices"]] == [c["text"] for c in got["choices"]]
    assert [c["logprobs"]["tokens"] for c in http["choices"]] == [c["logprobs"]["tokens"] for c in got["choices"]]
    assert http["usage"] == got["usage"]


def test_bad_bytes_and_deep_nesting_cost_one_line_each(run_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44 item 4: the file is decoded line by line; a bad line is its own error record, never the file's."""
    src = tmp_path / "in.jsonl"
    good = line("good-1", {**CHAT, "model": "tiny"}).encode()
    src.write_bytes(b"\n".join([
        good,
        b'{"custom_id": "latin-1", "body": {"model": "tiny", "prompt": "caf\xe9"}}',  # not UTF-8: that line only
        b"[" * 50_000 + b"]" * 50_000,  # a RecursionError in the JSON parser before
        line("deep", {**CHAT, "metadata": {"a": json.loads("[" * 40 + "]" * 40)}}).encode(),
        b"{not json",
        line("no-model", {**CHAT, "model": "nope"}).encode(),
        # raw U+2028 inside a JSON string: no line end for JSONL
        json.dumps({"model": "tiny", "prompt": "caf\u00e9 \u2028 ok", "max_tokens": 2}, ensure_ascii=False).encode(),
        line("good-2", {**CHAT, "model": "1"}).encode(),
    ]) + b"\n")
    out = tmp_path / "out.jsonl"
    code = main(["batch", "-i", str(src), "-o", str(out), str(run_dir), "--model", "tiny", "--backend", "torch",
                 "--no-progress", "--feddpa-routing", "fixed"])
    rows = read(out)
    assert [r["custom_id"] for r in rows] == ["good-1", "line-2", "line-3", "line-4", "line-5", "no-model", "line-7",
                                              "good-2"]
    assert [r["response"]["status_code"] for r in rows] == [200, 400, 400, 400, 400, 404, 200, 200]
    assert "not UTF-8" in rows[1]["error"]["message"]
    assert "deeper than" in rows[2]["error"]["message"] and "deeper than" in rows[3]["error"]["message"]
    for r in rows[1:6]:  # the OpenAI batch error format: the envelope as the body, its error object beside it
        assert r["response"]["body"] == {"error": r["error"]}
        assert set(r["error"]) == {"message", "type", "param", "code"}
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["succeeded"], summary["failed"]) == (3, 5)
    assert code == 1  # the exit status says some lines failed
