"""The demo tests' stack: ``fedmosaic quickstart`` on the tiny model, running in the background.

One session-scoped run of the README's first command (tiny random model, minimal budget): it trains
FedDPA-T on the generated suite, evaluates, serves the run with an API key and starts the Gradio demo.
The client, handler and browser tests talk to what it started; at the end the quick start gets SIGINT
(Ctrl-C) and must stop the server and the demo with it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-demo-test"
QUICKSTART_ARGS = ("--model", "tiny", "--rounds", "2", "--max-steps", "1", "--n-train", "4", "--n-test", "2",
                   "--eval-limit", "1", "--eval-max-new-tokens", "4", "--ready-timeout", "240")


@dataclass(frozen=True)
class Stack:
    """What the background quick start serves."""

    api: str
    demo: str
    out: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def output(self) -> str:
        """Everything the quick start and its children printed so far."""
        return self.log.read_text(errors="replace")


def quickstart_env() -> dict[str, str]:
    """One thread per child (three processes share this CPU), no telemetry."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0", "GRADIO_ANALYTICS_ENABLED": "False"}


def _terminal_sigint() -> None:
    """Give the child Ctrl-C as a terminal's foreground job has it.

    A test run launched in the background by a shell without job control (``cmd &`` in a script, some CI
    runners) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored, so the teardown's Ctrl-C
    would never reach the quick start and the fixture would wait out its 60 s instead of testing the stop.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def listening(url: str) -> bool:
    """True when something accepts TCP connections at ``url``'s host and port."""
    parts = urlparse(url)
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((parts.hostname or "127.0.0.1", parts.port or 80)) == 0


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Run ``fedmosaic quickstart`` (tiny) until its demo URL is printed; SIGINT it afterwards."""
    root = tmp_path_factory.mktemp("quickstart")
    out, log = root / "run", root / "quickstart.log"
    argv = [sys.executable, "-m", "fedmosaic.cli", "quickstart", *QUICKSTART_ARGS, "--out", str(out),
            "--port", "0", "--demo-port", "0", "--api-key", API_KEY]
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=quickstart_env(), start_new_session=True, preexec_fn=_terminal_sigint)
    deadline = time.monotonic() + 420
    text = ""
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        api, demo = re.search(r"\[quickstart\] API\s+(\S+)/v1", text), re.search(r"\[quickstart\] demo\s+(\S+)", text)
        if api and demo:
            break
        if proc.poll() is not None:
            pytest.fail(f"fedmosaic quickstart exited with {proc.returncode} before it was ready:\n{text[-6000:]}")
        time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"fedmosaic quickstart was not ready after 420 s:\n{text[-6000:]}")
    started = Stack(api.group(1), demo.group(1), out, log, proc)
    yield started
    # Ctrl-C: the quick start stops its children and exits 0; nothing may keep listening.
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the quick start did not stop within 60 s of SIGINT:\n{started.output()[-4000:]}")
    assert code == 0, started.output()[-4000:]
    assert not listening(started.api) and not listening(started.demo), "a child outlived the quick start"
