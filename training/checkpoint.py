"""Per-round checkpoints inside a run directory, written so that an interrupted run resumes exactly.

``rounds/<r>/`` holds the server state (``server.safetensors``, the exact tensors, plus ``global/`` as
a PEFT folder for evaluation), the strategy's extra state (``strategy.json``), every client's private
tensors (``clients/<id>/<name>.safetensors``) and, written last, ``COMPLETE``. Only rounds with that
marker count, so a crash mid-checkpoint never yields a half-written resume point.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from adapters import LoraConfig, write_adapter_folder
from adapters.rundir import RunDir, check_client_id
from training.protocol import StateDict

COMPLETE = "COMPLETE"


def _save(path: Path, state: StateDict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    os.close(fd)
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, tmp)
    os.replace(tmp, path)


def save_round(
    run: RunDir, round_idx: int, server: StateDict, strategy: dict[str, Any], private: dict[str, dict[str, StateDict]],
    lora: LoraConfig, base_model: str, peft_global: bool = True,
) -> Path:
    """Write round ``round_idx``'s checkpoint and mark it complete."""
    folder = run.round_dir(round_idx)
    if folder.exists():
        shutil.rmtree(folder)  # an incomplete earlier attempt at this round
    folder.mkdir(parents=True)
    _save(folder / "server.safetensors", server)
    if server and peft_global:
        write_adapter_folder(folder / "global", lora, server, base_model)
    (folder / "strategy.json").write_text(json.dumps(strategy))
    for client, named in private.items():
        for name, state in named.items():
            _save(folder / "clients" / check_client_id(client) / f"{name}.safetensors", state)
    (folder / COMPLETE).write_text("ok\n")
    return folder


def last_complete(run: RunDir) -> int | None:
    """The last round with a complete checkpoint, or None."""
    done = [r for r in run.rounds() if (run.round_dir(r) / COMPLETE).is_file()]
    return max(done) if done else None


def load_round(run: RunDir, round_idx: int) -> tuple[StateDict, dict[str, Any], dict[str, dict[str, StateDict]]]:
    """Read back (server state, strategy state, private states by client and name)."""
    folder = run.round_dir(round_idx)
    if not (folder / COMPLETE).is_file():
        raise FileNotFoundError(f"round {round_idx} has no complete checkpoint in {folder}")
    server = load_file(str(folder / "server.safetensors"))
    strategy = json.loads((folder / "strategy.json").read_text())
    private: dict[str, dict[str, StateDict]] = {}
    clients = folder / "clients"
    if clients.is_dir():
        for cdir in clients.iterdir():
            private[cdir.name] = {p.stem: load_file(str(p)) for p in cdir.glob("*.safetensors")}
    return server, strategy, private
