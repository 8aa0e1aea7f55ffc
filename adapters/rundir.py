"""The run-directory layout: where a training run keeps its adapters, shared by training, eval, serving.

    RUN_DIR/
      run.json                              method, data spec, base model, seed, settings, and
                                            ``inference_weight`` (FedDPA's lambda) when clients mix
      metrics.jsonl                         one JSON object per client per round, then per round; at
                                            the end one per client whose personalization trains
                                            (``"stage": "finalize"``, e.g. ``finetune_loss``)
      adapters/global/                      PEFT folder: the final global adapter
      adapters/clients/<id>/local/          PEFT folder: a client's private adapter (if the method has one)
      adapters/clients/<id>/embeddings.npy  the client's local-instance embeddings (FedDPA routing)
      adapters/clients/<id>/embeddings.faiss
      adapters/amole/                       FedAMoLE experts, token projections, assignments
      rounds/<r>/global/                    per-round checkpoints (plus rounds/<r>/clients/<id>/...)
      eval/                                 predictions cache, tables (Markdown, JSON), plots
      .lock                                 held by the one process writing the run (see ``RunDir.lock``)

Client ids are plain names; every path is built from them here and checked to stay inside the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.config import AdapterError

_CLIENT_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def check_client_id(client_id: str) -> str:
    """Return ``client_id`` if it is a safe plain name (no separators, no '..'), else raise."""
    if not _CLIENT_ID.match(client_id) or ".." in client_id:
        raise AdapterError(f"client id {client_id!r} must be a plain name (letters, digits, '_', '-', '.')")
    return client_id


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    root: Path

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def global_adapter(self) -> Path:
        return self.root / "adapters" / "global"

    @property
    def amole(self) -> Path:
        return self.root / "adapters" / "amole"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    def client_dir(self, client_id: str) -> Path:
        """``adapters/clients/<id>``."""
        return self.root / "adapters" / "clients" / check_client_id(client_id)

    def local_adapter(self, client_id: str) -> Path:
        """``adapters/clients/<id>/local``."""
        return self.client_dir(client_id) / "local"

    def embeddings(self, client_id: str) -> Path:
        """``adapters/clients/<id>/embeddings.npy``."""
        return self.client_dir(client_id) / "embeddings.npy"

    def round_dir(self, round_idx: int) -> Path:
        """``rounds/<r>``."""
        return self.root / "rounds" / str(int(round_idx))

    def clients(self) -> list[str]:
        """Client ids with a folder under ``adapters/clients`` (sorted naturally)."""
        base = self.root / "adapters" / "clients"
        if not base.is_dir():
            return []
        ids = [p.name for p in base.iterdir() if p.is_dir()]
        return sorted(ids, key=lambda s: (len(s), s) if s.isdigit() else (10**6, s))

    def rounds(self) -> list[int]:
        """Round numbers with a checkpoint folder."""
        base = self.root / "rounds"
        return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit()) if base.is_dir() else []

    def read_config(self) -> dict[str, Any]:
        """Return ``run.json`` (raises AdapterError when absent or unreadable)."""
        if not self.run_json.is_file():
            raise AdapterError(f"{self.root} is not a run directory (no run.json)")
        try:
            data = json.loads(self.run_json.read_text())
        except json.JSONDecodeError as exc:
            raise AdapterError(f"{self.run_json} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise AdapterError(f"{self.run_json} must hold a JSON object")
        return data

    @contextlib.contextmanager
    def lock(self, what: str = "training") -> Iterator[None]:
        """Hold the run's writer lock while ``what`` writes it; a second writer fails at once.

        Two trainers (or a trainer and ``--resume``) on one directory would interleave checkpoints
        and metrics rows, so the second gets a clear error instead. The lock is an ``flock`` on
        ``.lock``: the kernel drops it when the holder dies, so a crashed run never leaves the
        directory locked.

        Raises:
            AdapterError: another process holds the lock (its pid and activity are in the message).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = path.read_text().strip() or "another process"
                raise AdapterError(f"{self.root} is being written by {holder}; wait for it or use another --out") \
                    from None
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} ({what})".encode())
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock
