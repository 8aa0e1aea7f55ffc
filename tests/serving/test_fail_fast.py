"""``fedmosaic serve`` refuses a missing or malformed adapter source before it loads a model or opens its port,
naming the source; a base model's folder given as a source (vLLM's ``serve MODEL``) is served as the model."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models import tiny_llama
from serving.cli import add_serve_arguments, settings_from_args
from tests.serving.helpers import free_port, write_adapter


def serve(args: list[str], cwd: Path) -> tuple[int, str, bool]:
    """Run ``fedmosaic serve ARGS`` on a free port: (exit status, stderr, whether the port ever accepted)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedmosaic.cli", "serve", "--model", "tiny", "--port", str(port),
                             *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    opened = False
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket() as sock:
            opened = opened or sock.connect_ex(("127.0.0.1", port)) == 0
        time.sleep(0.05)
    if proc.poll() is None:  # it would serve: stop it
        proc.terminate()
    _, err = proc.communicate(timeout=30)
    return int(proc.returncode), err, opened


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    good = write_adapter(tiny_llama(), root / "good", seed=1)
    shutil.copytree(good, root / "torn")
    (root / "torn" / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    shutil.copytree(good, root / "badjson")
    (root / "badjson" / "adapter_config.json").write_text("{not json")
    return root


@pytest.mark.parametrize(("source", "named"), [
    ("missing", "the adapter folder missing does not exist (a source is a run directory or an adapter folder; "
                "to serve a base model, pass --model missing)"),
    ("x=badjson", "badjson/adapter_config.json is not valid JSON"),
    ("torn", "torn/adapter_model.safetensors is not a readable safetensors file"),
])
def test_a_bad_adapter_source_exits_naming_it_before_the_port_opens(folders: Path, source: str, named: str) -> None:
    status, err, opened = serve([source], folders)
    assert status != 0 and not opened
    assert err.strip().startswith(f"fedmosaic: adapter '{source.partition('=')[0]}': ") and named in err, err


def test_a_good_adapter_and_a_model_folder_pass_the_check(folders: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["serve", "--model", "tiny", str(folders / "good")]))
    assert settings.adapters == [f"good={folders / 'good'}"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    settings = settings_from_args(parser.parse_args(["serve", str(model), str(folders / "good"),
                                                     "--served-model-name", "base", "alias"]))
    assert settings.model == str(model) and settings.adapters == [f"good={folders / 'good'}"]
    assert (settings.served_model_name, settings.model_aliases) == ("base", ["alias"])
