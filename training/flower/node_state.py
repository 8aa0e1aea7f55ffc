"""A Flower node's private state (its local adapter, history) by version, in memory and in a durable mirror.

A version is the round whose ``fit`` produced the state; ``-1`` is the empty state before any. The
server names, in every message, the version the node must start from: the one of the client's last
reply that was aggregated (:class:`training.flower.transport.FlowerTransport` keeps that map in its
checkpointed state). So a node whose reply was rejected or never arrived, or a server that resumes
from an older round after a crash, starts the client exactly where the uninterrupted run would, even
though the node already holds newer versions. The message also names the oldest version a resume point
may still ask for; older ones are deleted.

The newest version lives in ``Context.state`` (fast, but gone when the SuperNode restarts or a new run
starts); every version is also mirrored to ``<mirror>/v<version>/`` as a folder written durably with a
manifest (:mod:`training.federation.durable`), read back when memory lacks the version. After the last round the
node's personalization goes to ``<mirror>/final/`` (its local adapter and, for FedDPA, its instance index).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from safetensors.torch import load_file, save_file

from training.federation import durable
from training.state import ClientState

MANIFEST = "MANIFEST"
FINAL = "final"
_PREFIX = "private."
_META = "private-meta"
_VERSION = re.compile(r"^v(\d+)$")


def _fill(private: ClientState) -> Callable[[Path], None]:
    def fill(folder: Path) -> None:
        files = []
        for name, state in private.items():
            files.append(folder / f"{name}.safetensors")
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(files[-1]))
        durable.write_manifest(folder / MANIFEST, folder, files)

    return fill


class PrivateStore:
    """One client's private state on its node.

    Args:
        context: the node's Flower context for this run (its ``state`` holds the newest version).
        mirror: the client's folder on the node's disk.
    """

    def __init__(self, context: Context, mirror: Path) -> None:
        self.context, self.mirror = context, Path(mirror)

    def versions(self) -> list[int]:
        """The versions in the mirror."""
        if not self.mirror.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.mirror.iterdir() if (m := _VERSION.match(p.name)))

    def _in_memory(self, version: int) -> ClientState | None:
        meta = self.context.state.get(_META)
        if not isinstance(meta, ConfigRecord) or meta.get("version") != version:
            return None
        names = meta.get("bf16")  # a list of "<state>/<key>", written only when one is bf16
        bf16 = set(names) if isinstance(names, list) else set()
        out: ClientState = {}
        for key, record in self.context.state.items():
            if key.startswith(_PREFIX) and isinstance(record, ArrayRecord):
                name = key[len(_PREFIX):]
                out[name] = {k: v.view(torch.bfloat16) if f"{name}/{k}" in bf16 else v
                             for k, v in record.to_torch_state_dict().items()}
        return out

    def load(self, version: int) -> ClientState:
        """The private state of ``version`` (-1: empty), from memory or the mirror.

        Raises:
            FileNotFoundError: the mirror lacks that version, or it does not read back as written.
        """
        if version < 0:
            return {}
        held = self._in_memory(version)
        if held is not None:
            return held
        folder = self.mirror / f"v{version}"
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"private state version {version} is not in {self.mirror} ({exc}); "
                                    f"it holds {self.versions()}") from exc
        problem = durable.manifest_problem(folder, manifest)
        if problem is not None:
            raise FileNotFoundError(f"private state version {version} in {folder} is damaged: {problem}")
        return {p.stem: load_file(str(p)) for p in sorted(folder.glob("*.safetensors"))}

    def save(self, version: int, private: ClientState) -> None:
        """Keep ``private`` as ``version``: durably in the mirror, then in memory."""
        durable.write_folder(self.mirror / f"v{version}", _fill(private))
        for key in [k for k in self.context.state.keys() if k.startswith(_PREFIX)]:
            del self.context.state[key]
        bf16 = [f"{name}/{k}" for name, state in private.items() for k, v in state.items() if v.dtype == torch.bfloat16]
        for name, state in private.items():  # numpy (ArrayRecord) has no bfloat16: its bits travel as int16
            self.context.state[f"{_PREFIX}{name}"] = ArrayRecord(torch_state_dict={
                k: v.detach().cpu().contiguous().view(torch.int16) if v.dtype == torch.bfloat16 else v
                for k, v in state.items()})
        self.context.state[_META] = ConfigRecord({"version": int(version), **({"bf16": bf16} if bf16 else {})})

    def prune(self, keep_from: int) -> list[int]:
        """Delete the mirror's versions older than ``keep_from`` (no resume point can ask for them)."""
        gone = [v for v in self.versions() if v < keep_from]
        for v in gone:
            shutil.rmtree(self.mirror / f"v{v}", ignore_errors=True)
        return gone

    def save_final(self, build: Callable[[Path], ClientState]) -> None:
        """Write ``<mirror>/final/``: ``build(folder)`` personalizes (writing any index into the folder) and
        returns the private state, whose ``local`` adapter is saved beside it."""
        def fill(folder: Path) -> None:
            private = build(folder)
            if "local" in private:
                save_file({k: v.detach().contiguous().cpu() for k, v in private["local"].items()},
                          str(folder / "local.safetensors"))

        durable.write_folder(self.mirror / FINAL, fill)
