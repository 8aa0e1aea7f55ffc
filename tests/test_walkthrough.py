"""A user's own material from a fresh directory: CSV -> partitioned all-linear training -> eval -> serve -> export.

What a newcomer does: write a CSV whose columns have their own names, look at the split ``fedmosaic data
show`` would make, train FedDPA-T on it with a Dirichlet split by topic and LoRA on every linear layer,
evaluate the run, serve it as a real ``fedmosaic serve`` process and ask one client's adapter over the
OpenAI API, then export that client as a PEFT folder and load it back with PEFT. All through the
``fedmosaic`` command, with relative paths from an empty working directory (the tiny random model).
"""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from peft import PeftModel

from fedmosaic.cli import main
from models import tiny_llama

TOPICS = ("cooking", "travel", "finance")
COLUMNS = "instruction=question,input=context,output=answer"


def write_faq(path: Path, n: int) -> None:
    """A CSV as a user would have it: their own column names, a topic per row, an optional context."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["question", "context", "answer", "topic"])
        writer.writeheader()
        for i in range(n):
            topic = TOPICS[i % 3] if i % 5 else TOPICS[0]  # cooking the largest topic
            writer.writerow({"question": f"{topic} question {i}?", "context": "" if i % 2 else f"note {i}",
                             "answer": f"{topic} answer {i}", "topic": topic})


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_and_ask(run: Path, client: str) -> tuple[set[str], dict[str, Any]]:
    """Start ``fedmosaic serve RUN`` as a user would, ask ``client`` one chat question, stop the server."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedmosaic.cli", "serve", str(run), "--model", "tiny",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else "the server exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.5)
        client_api = OpenAI(base_url=f"{url}/v1", api_key="none")
        listed = {m.id for m in client_api.models.list().data}
        reply = client_api.chat.completions.create(
            model=client, messages=[{"role": "user", "content": "cooking question 3?"}], max_tokens=4,
            temperature=0)
        return listed, reply.model_dump()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_own_csv_to_all_linear_training_eval_serving_and_a_peft_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDMOSAIC_DATA_DIR", raising=False)
    Path("faq").mkdir()
    write_faq(Path("faq/train.csv"), 36)
    write_faq(Path("faq/test.csv"), 6)
    split = ["--partition", "dirichlet:0.5", "--by", "topic", "--clients", "3", "--seed", "1"]

    assert main(["data", "show", "faq", "--columns", COLUMNS, *split, "--n", "1"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("faq: 3 clients, partition dirichlet:0.5, by topic, clients 3, seed 1\n")
    assert "### Instruction:\n" in shown and "### Input:\n" in shown  # the prompt training will use

    assert main(["train", "--method", "feddpa-t", "--data", "faq", "--columns", COLUMNS, *split,
                 "--rounds", "1", "--model", "tiny", "--preset", "tiny", "--target-modules", "all-linear",
                 "--out", "runs/faq"]) == 0
    run = Path("runs/faq")
    recorded = json.loads((run / "split.json").read_text())
    assert recorded["partition"] == {"scheme": "dirichlet", "by": "topic", "clients": 3, "seed": 1, "alpha": 0.5,
                                     "shards": None}
    rows = recorded["clients"]
    assert sorted(i for r in rows.values() for i in r) == list(range(36))  # every row in exactly one client
    table = shown.split("\n\n")[0].splitlines()[2:]  # data show's table is the split training made
    for line, (client, picked) in zip(table, rows.items(), strict=True):
        assert line.split()[:2] == [client, str(len(picked))]
        assert np.load(run / "adapters" / "clients" / client / "embeddings.npy").shape[0] == len(picked)

    # LoRA on every linear layer of the decoder, as PEFT's all-linear means, recorded for PEFT to read
    client = next(iter(rows))
    local = json.loads((run / "adapters" / "clients" / client / "local" / "adapter_config.json").read_text())
    assert local["target_modules"] == "all-linear"

    assert main(["eval", "runs/faq", "--limit", "2", "--max-new-tokens", "4"]) == 0
    assert (run / "eval" / "table.md").is_file()

    listed, reply = serve_and_ask(run, client)
    assert client in listed and "global" in listed
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 1

    capsys.readouterr()
    assert main(["export", "runs/faq", "--client", client, "--weight", "0.5", "--out", f"exported/{client}"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["weights"] == {"global": 0.5, "local": 0.5}
    base = tiny_llama().model.eval()
    ids = torch.tensor([[5, 17, 33, 8, 90, 4, 7]])
    with torch.no_grad():
        plain = base(ids).logits
        peft = PeftModel.from_pretrained(base, f"exported/{client}").eval()
        adapted = {name.split(".")[-2] for name, _ in peft.named_modules() if name.endswith(".lora_A")}
        assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert not torch.equal(peft(ids).logits, plain)  # the exported client changes the model
