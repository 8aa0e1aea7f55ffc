"""Processes of the quick start: one-shot steps, the server and demo children, readiness, a sample answer.

Each stage of ``fedmosaic quickstart`` is its own ``fedmosaic`` (or ``python -m demos``) process with
the terminal's output, so the progress bars of preparation, training and evaluation show as they are,
a crash names its stage, and the quick start itself stays light (no model in its memory). Only the
standard library speaks HTTP here (``urllib``), so this works in an environment without the demo extra.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm


class QuickstartError(RuntimeError):
    """A stage of the quick start failed; the message names it and what to do."""


def say(message: str) -> None:
    """One line of the quick start's own narration (flushed, so it interleaves with the children)."""
    print(f"[quickstart] {message}", flush=True)


def fedmosaic_argv(*args: str) -> list[str]:
    """The ``fedmosaic`` command in this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "fedmosaic.cli", *args]


def child_env() -> dict[str, str]:
    """The children's environment: unbuffered output, no Gradio analytics (nothing leaves the machine)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}


def run_step(name: str, argv: Sequence[str]) -> None:
    """Run one stage to completion with the terminal's output.

    Raises:
        QuickstartError: the stage exited non-zero.
    """
    began = time.perf_counter()
    code = subprocess.run(list(argv), env=child_env(), stdin=subprocess.DEVNULL, check=False).returncode
    if code != 0:
        raise QuickstartError(f"{name} failed (exit code {code}); its output is above. Command: {' '.join(argv)}")
    say(f"{name}: done in {time.perf_counter() - began:.0f} s")


def port_free(host: str, port: int) -> bool:
    """True when ``port`` can be bound on ``host`` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str, wanted: int) -> int:
    """``wanted`` when free (and not 0), else any free port."""
    if wanted and port_free(host, wanted):
        return wanted
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    if wanted:
        say(f"port {wanted} is taken; using {port}")
    return port


@dataclass
class Child:
    """A long-running child (the API server or the demo)."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(cls, name: str, argv: Sequence[str], url: str, env: Mapping[str, str] | None = None) -> Child:
        """Start ``argv`` with the terminal's output (``env`` added to the children's environment)."""
        return cls(name, subprocess.Popen(list(argv), env={**child_env(), **(env or {})}, stdin=subprocess.DEVNULL),
                   url)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """Terminate (SIGTERM), then kill after ``grace`` seconds."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def http_json(method: str, url: str, body: Mapping[str, Any] | None = None, api_key: str | None = None,
              timeout: float = 300.0) -> Any:
    """One JSON request; returns the decoded body.

    Raises:
        urllib.error.HTTPError: a 4xx/5xx answer (its body is the OpenAI error envelope).
        urllib.error.URLError: nothing answers at ``url``.
    """
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode() or "null")


def wait_ready(child: Child, url: str, timeout: float) -> float:
    """Poll ``url`` until it answers 200 (a progress bar counts the seconds); returns the seconds waited.

    Raises:
        QuickstartError: the child exited first, or ``timeout`` passed.
    """
    began = time.perf_counter()
    with tqdm(desc=f"waiting for the {child.name}", unit="s", total=None, leave=False) as bar:
        while True:
            if not child.alive():
                raise QuickstartError(f"the {child.name} exited with code {child.proc.returncode} before it was "
                                      "ready; its output is above")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return time.perf_counter() - began
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            waited = time.perf_counter() - began
            if waited > timeout:
                raise QuickstartError(f"the {child.name} was not ready at {url} after {timeout:.0f} s")
            time.sleep(1.0)
            bar.update(round(time.perf_counter() - began - bar.n))


def supervise(children: Sequence[Child]) -> int:
    """Block until Ctrl-C (0) or until a child exits on its own (1); always stops every child."""
    try:
        while True:
            for child in children:
                if not child.alive():
                    say(f"the {child.name} exited with code {child.proc.returncode}; stopping")
                    return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        say("stopping")
        return 0
    finally:
        for child in children:
            child.stop()
