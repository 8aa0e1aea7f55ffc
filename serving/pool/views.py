"""The adapter pool's records and its read-only views, each taken under the records' state lock.

``/v1/models``, ``/metrics`` and target resolution read the pool from request threads while runtime
loads, evictions and lease releases change it from others; every view reads the shared dictionaries
under the same lock their writers hold, so none iterates a dictionary while it changes size. That lock
is not the engine's model lock: a view never waits for the engine's step in flight.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from serving.errors import AdapterExists

if TYPE_CHECKING:
    from serving.engine.amole import AMoLEBundle
    from serving.pool.amole import AMoLERegistry


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


class RunPool(Protocol):
    """What registering a run needs of a pool (:func:`serving.pool.run.register_run`, whose
    :class:`serving.pool.pool.AdapterPool` has it; a protocol, so those modules never import the pool)."""

    max_loras: int

    def resolve(self, path: str | Path) -> Path:
        """``path`` resolved inside the pool's root."""
        ...

    def load(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False,
             client_prefix: str | None = None) -> AdapterInfo:
        """Load the folder ``path`` as ``name`` now (an AMoLE model's clients under ``client_prefix``)."""
        ...

    def register(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False) -> AdapterInfo:
        """Register the folder ``path`` as ``name``, loaded when first used."""
        ...

    def loaded_count(self) -> int:
        """Adapters in the model now."""
        ...


class AdapterTable:
    """The pool's records (entries by name, leases, retired versions) and its read-only views.

    Every read and write of the records holds ``state``; :class:`~serving.pool.pool.AdapterPool`
    changes the model's adapters and updates the records under it, and these views read them.

    Args:
        amole: the registry of the AMoLE versions resident in the model.
    """

    def __init__(self, amole: AMoLERegistry) -> None:
        self.state = threading.RLock()  # the records below; taken after the model lock when both are
        self.amole = amole
        self.entries: dict[str, Entry] = {}
        self.leases: dict[str, int] = {}  # internal name -> requests holding it
        self.retired: set[str] = set()  # replaced or unloaded versions still leased
        self.versions: dict[str, int] = {}  # never reset, so a name's versions never repeat
        self.owners: dict[str, str] = {}  # AMoLE client name -> its entry's name
        self.prefixes: dict[str, str] = {}  # AMoLE model name -> its clients' served-name prefix (kept on unload)
        self._tick = 0

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` as the most recently used (the LRU order of eviction)."""
        self._tick += 1
        entry.last_used = self._tick

    def snapshot(self, entry: Entry) -> AdapterInfo:
        """``entry`` as an :class:`AdapterInfo` (call under ``state``)."""
        leases = self.leases.get(entry.internal, 0) if entry.internal else 0
        return AdapterInfo(entry.name, entry.version, entry.path, entry.pinned, entry.internal is not None, leases,
                           entry.kind, entry.clients)

    def registered(self, name: str, replace: bool) -> Entry | None:
        """The entry registered as ``name`` (None if none); AdapterExists unless ``replace``."""
        old = self.entries.get(name)
        if old is not None and not replace:
            raise AdapterExists(f"adapter {name!r} is already loaded; unload it or ask for a reload")
        return old

    def check_names(self, name: str, clients: tuple[str, ...]) -> None:
        """Refuse names that would make a ``model`` name ambiguous (a client served twice)."""
        if name in self.owners:
            raise AdapterExists(f"{name!r} is a client of the AMoLE model {self.owners[name]!r}")
        for client in clients:
            owner = self.owners.get(client, name)
            if owner != name or (client in self.entries and client != name):
                raise AdapterExists(f"AMoLE client {client!r} of {name!r} clashes with the served "
                                    f"{'AMoLE model ' + repr(owner) if owner != name else 'adapter'}")

    def put(self, entry: Entry) -> None:
        """Register ``entry`` under its name, with its AMoLE clients."""
        self.entries[entry.name] = entry
        for client in entry.clients:
            self.owners[client] = entry.name

    def forget_clients(self, entry: Entry) -> None:
        """Stop serving ``entry``'s AMoLE clients."""
        for client in entry.clients:
            if self.owners.get(client) == entry.name:
                del self.owners[client]

    # --- read-only views -----------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        """True for a registered LoRA adapter name (AMoLE models and clients: :meth:`amole_model_of`)."""
        with self.state:
            entry = self.entries.get(name) if isinstance(name, str) else None
            return entry is not None and entry.kind == "lora"

    def names(self) -> list[str]:
        """Registered LoRA adapter names, in registration order."""
        with self.state:
            return [n for n, e in self.entries.items() if e.kind == "lora"]

    def amole_models(self) -> list[str]:
        """Registered AMoLE model names, in registration order."""
        with self.state:
            return [n for n, e in self.entries.items() if e.kind == "amole"]

    def amole_clients(self) -> list[str]:
        """Every AMoLE client served, by model then assignment order."""
        with self.state:
            return [c for e in self.entries.values() if e.kind == "amole" for c in e.clients]

    def amole_model_of(self, client: str) -> str | None:
        """The AMoLE model serving ``client``, or None."""
        with self.state:
            return self.owners.get(client)

    def amole_bundle(self, name: str) -> AMoLEBundle | None:
        """The loaded version of AMoLE model ``name`` (None while evicted or unknown)."""
        with self.state:
            entry = self.entries.get(name)
            return self.amole.get(entry.internal) if entry is not None and entry.internal else None

    def version(self, name: str) -> int | None:
        """The current version of ``name`` (it changes on every load, reload and reactivation), or None."""
        with self.state:
            entry = self.entries.get(name)
            return entry.version if entry is not None else None

    def info(self, name: str | None = None) -> list[AdapterInfo]:
        """Snapshots of one registered adapter or of all."""
        with self.state:
            entries = [self.entries[name]] if name is not None and name in self.entries else (
                [] if name is not None else list(self.entries.values()))
            return [self.snapshot(e) for e in entries]

    def loaded_count(self) -> int:
        """Adapters currently in the model (current versions only)."""
        with self.state:
            return sum(e.internal is not None for e in self.entries.values())

    def client_prefix(self, name: str) -> str:
        """The prefix the AMoLE model ``name`` serves its clients under (kept after an unload, so a
        reload from the same folder serves the same names)."""
        with self.state:
            return self.prefixes.get(name, "")
