"""The adapter pool's records and its read-only views, each taken under the pool's state lock.

``/v1/models``, ``/metrics`` and target resolution read the pool from request threads while runtime
loads, evictions and lease releases change it from others; every view reads the shared dictionaries
under the same lock their writers hold, so none iterates a dictionary while it changes size. That lock
is not the engine's model lock: a view never waits for the engine's step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    from serving.amole_router import AMoLEBundle, AMoLERegistry
    from serving.model_lock import ModelLock


@dataclass(frozen=True)
class AdapterInfo:
    """A snapshot of one registered adapter (for ``/v1/models`` and metrics)."""

    name: str
    version: int
    path: Path
    pinned: bool
    loaded: bool
    leases: int
    kind: str = "lora"
    clients: tuple[str, ...] = ()


@dataclass(eq=False)
class Entry:
    """A registered adapter's bookkeeping (the pool's, read and written under its state lock)."""

    name: str
    path: Path
    pinned: bool
    version: int = 0
    internal: str | None = None  # None while evicted
    last_used: int = 0
    kind: str = "lora"  # or "amole"
    clients: tuple[str, ...] = ()  # AMoLE: the clients it serves


class PoolViews:
    """The pool's views (mixed into :class:`~serving.adapter_pool.AdapterPool`, which owns the state)."""

    lock: ModelLock
    state: threading.RLock
    amole: AMoLERegistry
    _entries: dict[str, Entry]
    _amole_clients: dict[str, str]

    def _info(self, entry: Entry) -> AdapterInfo:
        raise NotImplementedError

    def __contains__(self, name: object) -> bool:
        """True for a registered LoRA adapter name (AMoLE models and clients: :meth:`amole_model_of`)."""
        with self.state:
            entry = self._entries.get(name) if isinstance(name, str) else None
            return entry is not None and entry.kind == "lora"

    def names(self) -> list[str]:
        """Registered LoRA adapter names, in registration order."""
        with self.state:
            return [n for n, e in self._entries.items() if e.kind == "lora"]

    def amole_models(self) -> list[str]:
        """Registered AMoLE model names, in registration order."""
        with self.state:
            return [n for n, e in self._entries.items() if e.kind == "amole"]

    def amole_clients(self) -> list[str]:
        """Every AMoLE client served, by model then assignment order."""
        with self.state:
            return [c for e in self._entries.values() if e.kind == "amole" for c in e.clients]

    def amole_model_of(self, client: str) -> str | None:
        """The AMoLE model serving ``client``, or None."""
        with self.state:
            return self._amole_clients.get(client)

    def amole_bundle(self, name: str) -> AMoLEBundle | None:
        """The loaded version of AMoLE model ``name`` (None while evicted or unknown)."""
        with self.state:
            entry = self._entries.get(name)
            return self.amole.get(entry.internal) if entry is not None and entry.internal else None

    def version(self, name: str) -> int | None:
        """The current version of ``name`` (it changes on every load, reload and reactivation), or None."""
        with self.state:
            entry = self._entries.get(name)
            return entry.version if entry is not None else None

    def info(self, name: str | None = None) -> list[AdapterInfo]:
        """Snapshots of one registered adapter or of all."""
        with self.state:
            entries = [self._entries[name]] if name is not None and name in self._entries else (
                [] if name is not None else list(self._entries.values()))
            return [self._info(e) for e in entries]

    def loaded_count(self) -> int:
        """Adapters currently in the model (current versions only)."""
        with self.state:
            return sum(e.internal is not None for e in self._entries.values())
