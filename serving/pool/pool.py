"""The adapter pool: which PEFT adapters are loaded in the model, under which version, and for how long.

Placement only (names, versions, capacity); the math lives in :mod:`adapters`. Rules:

* Every load, including a reload under the same name, gets a new version and its own engine-internal
  adapter name ``<name>@<version>``, so nothing keyed by an internal name (the layers' stacked-tensor
  caches, any future prefix cache) is ever reused across versions (vLLM #42125).
* Requests hold a :class:`Lease` on the versions they started with. A replaced or unloaded version
  leaves the model only when its last lease is released, so an in-flight request never decodes with
  another adapter's weights (vLLM #47724).
* At most ``max_loras`` adapters are loaded; loading or reactivating one more evicts the least
  recently used one that is neither pinned nor leased. Evicted adapters stay registered and are
  reloaded from their folder (under a new version) when next used. Nothing evictable: NoFreeSlot.
* Adapter paths are resolved (symlinks included) and must stay inside the configured root
  (:mod:`serving.pool.paths`).

A training run directory (:mod:`adapters.rundir`) registers ``global`` and ``<client>:local`` for each
client (:mod:`serving.pool.run`), and records each client's embedding files for FedDPA routing (paper
000 section 4.3) without loading them; local adapters beyond the free slots are only registered
(:meth:`AdapterPool.register`, loaded on first use like evicted ones), so a run with 1,000 clients
neither reads 1,000 adapters at start-up nor holds more than ``max_loras``. The pool's bookkeeping has a
lock of its own: leasing adapters already in the model and every read-only view (:mod:`serving.pool.views`)
take only that one, so a request never waits for the engine's step in flight (it did, once to resolve its
target and once more to lease, a step each under load). Whatever changes the model's adapters (a load,
a reload, an eviction, dropping a released version) holds the engine's model lock first, then that one.

A FedAMoLE model (an ``adapters/amole`` folder, or a run directory holding one; paper 002) is one
entry too, of kind ``amole`` (:mod:`serving.engine.amole`): it takes one slot, versions and leases
like a LoRA adapter, and serves each client of its assignments under the client's own name. A lease
on a client hands out a typed :class:`~serving.engine.amole.AMoLEClientRoute` (the bundle version and
that client's assignment only), which the request carries to the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from adapters import AdaptedModel, AdapterError, load_adapter
from adapters.io import CONFIG_FILE, WEIGHTS_FILE
from serving.engine.amole import AMoLEBundle, AMoLEClientRoute
from serving.engine.model_lock import ModelLock
from serving.errors import AdapterLoadFailed, AdapterNotFound, AdapterPinned, InvalidRequest, NoFreeSlot
from serving.pool.amole import AMoLERegistry, amole_folder, client_names, load_bundle, unload_bundle
from serving.pool.paths import check_adapter_name, check_folder_files, resolve_adapter_path
from serving.pool.run import RunInfo, register_run
from serving.pool.views import AdapterInfo, AdapterTable, Entry

__all__ = ["AdapterPool", "Lease"]


class Lease:
    """The adapter versions a request decodes with; release exactly once when it finishes.

    ``names`` are the internal names of its plain adapters (they go into the request's
    ``adapter_names``); ``route`` is its AMoLE client's route when it leased one; ``keys`` are the
    versions held.
    """

    def __init__(self, pool: AdapterPool, names: tuple[str, ...], keys: tuple[str, ...] | None = None,
                 route: AMoLEClientRoute | None = None) -> None:
        self.pool = pool
        self.names = names
        self.route = route
        self.keys = names if keys is None else keys
        self._released = False

    def release(self, *_: object) -> None:
        """Give the versions back (idempotent; accepts and ignores a done-callback argument)."""
        if not self._released:
            self._released = True
            self.pool._release(self.keys)


class AdapterPool:
    """Named, versioned, capacity-limited adapters in one :class:`~adapters.AdaptedModel`.

    The records and their read-only views are an :class:`~serving.pool.views.AdapterTable` the pool
    owns (``table``); the pool changes the model's adapters and the records together.

    Args:
        adapted: the injected model the adapters live in.
        root: adapter folders must resolve inside it; None allows any folder (trusted CLI use only).
        max_loras: adapters loaded at once.
        model_lock: the engine's model lock (every change to the model happens under it).
        check_base: refuse adapters trained on another base model.
        amole: the registry of the AMoLE versions resident in the model (default: a new one).
    """

    def __init__(self, adapted: AdaptedModel, root: Path | None = None, max_loras: int = 8,
                 model_lock: ModelLock | None = None, check_base: bool = True,
                 amole: AMoLERegistry | None = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.adapted = adapted
        self.root = root.resolve() if root is not None else None
        self.max_loras = max_loras
        self.lock = model_lock if model_lock is not None else ModelLock()
        self.check_base = check_base
        self.amole = amole if amole is not None else AMoLERegistry()
        self.table = AdapterTable(self.amole)

    # --- read-only views (the table's: its state lock only, never the model lock) ----------------

    def __contains__(self, name: object) -> bool:
        """True for a registered LoRA adapter name (:meth:`AdapterTable.__contains__`)."""
        return name in self.table

    def names(self) -> list[str]:
        """Registered LoRA adapter names, in registration order."""
        return self.table.names()

    def amole_models(self) -> list[str]:
        """Registered AMoLE model names, in registration order."""
        return self.table.amole_models()

    def amole_clients(self) -> list[str]:
        """Every AMoLE client served, by model then assignment order."""
        return self.table.amole_clients()

    def amole_model_of(self, client: str) -> str | None:
        """The AMoLE model serving ``client``, or None."""
        return self.table.amole_model_of(client)

    def amole_bundle(self, name: str) -> AMoLEBundle | None:
        """The loaded version of AMoLE model ``name`` (None while evicted or unknown)."""
        return self.table.amole_bundle(name)

    def version(self, name: str) -> int | None:
        """The current version of ``name``, or None."""
        return self.table.version(name)

    def info(self, name: str | None = None) -> list[AdapterInfo]:
        """Snapshots of one registered adapter or of all."""
        return self.table.info(name)

    def loaded_count(self) -> int:
        """Adapters currently in the model (current versions only)."""
        return self.table.loaded_count()

    def client_prefix(self, name: str) -> str:
        """The prefix the AMoLE model ``name`` serves its clients under (kept after an unload)."""
        return self.table.client_prefix(name)

    # --- paths ---------------------------------------------------------------------------------

    def resolve(self, path: str | Path) -> Path:
        """Resolve ``path`` inside the pool's root (:func:`serving.pool.paths.resolve_adapter_path`)."""
        return resolve_adapter_path(path, self.root)

    # --- registration --------------------------------------------------------------------------

    def load(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False,
             client_prefix: str | None = None) -> AdapterInfo:
        """Load the PEFT folder ``path`` as ``name`` (a new version when ``replace`` reloads a name).

        ``path`` may also be a FedAMoLE folder or run directory: ``name`` then names the AMoLE model
        and its clients are served under their own names, each prefixed with ``client_prefix``
        (None: the prefix ``name`` was last loaded with, none at first; a run's aggregated pool
        beside its clients' own models serves ``amole:<client>``, :mod:`serving.pool.amole_run`).

        Raises:
            AdapterExists: ``name`` (or one of an AMoLE model's clients) is registered and
                ``replace`` is False.
            PathNotAllowed, AdapterLoadFailed, NoFreeSlot: see the module docstring.
        """
        check_adapter_name(name)
        folder = self.resolve(path)
        amole = amole_folder(folder)
        if amole is None and (folder / "run.json").is_file():
            raise AdapterLoadFailed(f"{path} is a training run without FedAMoLE experts; serve FedDPA runs with "
                                    "`fedmosaic serve RUN_DIR`, or load their adapter folders one by one")
        prefix = self.client_prefix(name) if client_prefix is None else client_prefix
        try:
            clients = tuple(prefix + c for c in client_names(amole)) if amole is not None else ()
        except AdapterError as exc:
            raise AdapterLoadFailed(str(exc)) from exc
        table = self.table
        with self.lock, table.state:
            old = table.registered(name, replace)
            table.check_names(name, clients)
            entry = Entry(name=name, path=amole or folder, pinned=pinned if old is None else (pinned or old.pinned),
                           kind="amole" if amole is not None else "lora", clients=clients)
            self._activate(entry, exclude=(name,), spare=int(old is not None and old.internal is not None))
            if old is not None:
                self._retire(old)
                table.forget_clients(old)
            table.put(entry)
            if amole is not None:
                table.prefixes[name] = prefix
            return table.snapshot(entry)

    def register(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False) -> AdapterInfo:
        """Register the PEFT folder ``path`` as ``name`` without loading it (it loads when first leased).

        Only the name, the path and the folder's two PEFT files are checked now; a folder that does not
        fit the model raises AdapterLoadFailed when first leased (as an evicted one whose folder changed).

        Raises:
            AdapterExists: ``name`` is registered and ``replace`` is False.
            PathNotAllowed, AdapterLoadFailed: see :meth:`load`.
        """
        check_adapter_name(name)
        folder = self.resolve(path)
        check_folder_files(folder, self.root)
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
        if missing:
            raise AdapterLoadFailed(f"adapter folder {path} has no {' or '.join(missing)}")
        table = self.table
        with self.lock, table.state:
            old = table.registered(name, replace)
            table.check_names(name, ())
            entry = Entry(name=name, path=folder, pinned=pinned if old is None else (pinned or old.pinned))
            if old is not None:
                self._retire(old)
                table.forget_clients(old)
            table.put(entry)
            return table.snapshot(entry)

    def unload(self, name: str, force: bool = False) -> None:
        """Forget ``name``; its version leaves the model once no request holds it.

        Raises:
            AdapterNotFound: ``name`` is not registered (or is an AMoLE client, not a model).
            AdapterPinned: ``name`` is pinned and ``force`` is False.
        """
        table = self.table
        with self.lock, table.state:
            if name in table.owners:
                raise AdapterNotFound(f"{name!r} is a client of the AMoLE model {table.owners[name]!r}; "
                                      "unload that model")
            entry = table.entries.get(name)
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded")
            if entry.pinned and not force:
                raise AdapterPinned(f"adapter {name!r} is pinned (targets built on it stop working without it); "
                                    "unload it with force")
            del table.entries[name]
            self._retire(entry)
            table.forget_clients(entry)

    def load_run(self, run_dir: str | Path, pin_global: bool = True) -> RunInfo:
        """Register a training run's global adapter and every client's local adapter (:mod:`serving.pool.run`).

        Args:
            run_dir: a run directory (``run.json``, ``adapters/global``, ``adapters/clients/<id>/local``).
            pin_global: pin ``global`` (every FedDPA request uses it).
        """
        return register_run(self, run_dir, pin_global)

    # --- leases --------------------------------------------------------------------------------

    def acquire(self, names: Iterable[str]) -> Lease:
        """Lease the current versions of ``names`` (reloading evicted ones) for one request.

        ``names`` are adapter names or one AMoLE client's name (alone: a client routes every token
        over its own experts, it does not mix with plain adapters).

        Returns:
            A lease whose ``names`` are the plain adapters' internal names, in order, and whose
            ``route`` is the AMoLE client's route (None without one).

        Raises:
            AdapterNotFound: a name is not registered.
            InvalidRequest: an AMoLE client named together with other adapters.
            NoFreeSlot: an evicted adapter cannot be reloaded because nothing can be evicted.
        """
        wanted = tuple(names)
        with self.table.state:  # versions already in the model: no wait for the engine's step
            lease = self._lease(wanted, activate=False)
        if lease is not None:
            return lease
        with self.lock, self.table.state:  # an evicted or registered-only adapter is loaded into the model first
            lease = self._lease(wanted, activate=True)
            assert lease is not None
            return lease

    def _lease(self, wanted: tuple[str, ...], activate: bool) -> Lease | None:
        """Lease ``wanted`` (see :meth:`acquire`); None when one must be loaded first and ``activate`` is False."""
        table = self.table
        missing = [n for n in wanted if n not in table.owners
                   and (n not in table.entries or table.entries[n].kind != "lora")]
        if missing:
            raise AdapterNotFound(f"adapters {missing} are not loaded")
        routed = [n for n in wanted if n in table.owners]
        if routed and len(wanted) > 1:
            raise InvalidRequest(f"the AMoLE client {routed[0]!r} routes every token itself; request it alone",
                                 param="model")
        owners = tuple(table.owners.get(n, n) for n in wanted)
        if not activate and any(table.entries[o].internal is None for o in owners):
            return None
        plain, keys, route = [], [], None
        for name, owner in zip(wanted, owners, strict=True):
            entry = table.entries[owner]
            if entry.internal is None:
                self._activate(entry, exclude=owners)
            table.touch(entry)
            assert entry.internal is not None
            keys.append(entry.internal)
            if entry.kind == "amole":  # the served name less the model's prefix is the assignment's key
                route = self.amole.route(entry.internal, name[len(table.prefixes.get(owner, "")):])
            else:
                plain.append(entry.internal)
        for key in keys:
            table.leases[key] = table.leases.get(key, 0) + 1
        return Lease(self, tuple(plain), tuple(keys), route)

    def _release(self, internal: tuple[str, ...]) -> None:
        table = self.table
        with table.state:
            done = []
            for key in internal:
                table.leases[key] -= 1
                if table.leases[key] == 0:
                    del table.leases[key]
                    done.append(key)
            if not any(key in table.retired for key in done):
                return
        with self.lock, table.state:  # a replaced version leaves the model: the model lock first
            for key in done:
                if key in table.retired and not table.leases.get(key):
                    table.retired.discard(key)
                    self._drop(key)

    # --- internals -----------------------------------------------------------------------------

    def _activate(self, entry: Entry, exclude: tuple[str, ...], spare: int = 0) -> None:
        """Load ``entry``'s folder into the model under a fresh version, evicting if full.

        ``spare`` counts loaded versions about to be retired (a reload replaces its old version).
        """
        if self.loaded_count() - spare >= self.max_loras:
            self._evict(exclude)
        version = self.table.versions.get(entry.name, 0) + 1
        internal = f"{entry.name.replace('.', '%')}@{version}"  # layer names may not contain dots
        check_folder_files(entry.path, self.root)  # at every (re)load: the files are read now
        try:
            if entry.kind == "amole":
                self.amole.add(load_bundle(self.adapted, entry.path, entry.name, internal, self.check_base))
            else:
                load_adapter(self.adapted, entry.path, internal, check_base=self.check_base)
        except AdapterError as exc:
            raise AdapterLoadFailed(str(exc)) from exc
        self.table.versions[entry.name] = version
        entry.version, entry.internal = version, internal
        self.table.touch(entry)

    def _evict(self, exclude: tuple[str, ...]) -> None:
        candidates = [e for e in self.table.entries.values()
                      if e.internal is not None and not e.pinned and e.name not in exclude
                      and self.table.leases.get(e.internal, 0) == 0]
        if not candidates:
            raise NoFreeSlot(
                f"all {self.max_loras} adapter slots hold pinned or in-use adapters; unload one, unpin one, "
                "or raise --max-loras")
        victim = min(candidates, key=lambda e: e.last_used)
        assert victim.internal is not None
        self._drop(victim.internal)
        victim.internal = None

    def _retire(self, entry: Entry) -> None:
        if entry.internal is None:
            return
        if self.table.leases.get(entry.internal, 0) > 0:
            self.table.retired.add(entry.internal)
        else:
            self._drop(entry.internal)
        entry.internal = None

    def _drop(self, internal: str) -> None:
        """Take one version out of the model (an AMoLE version: all its experts)."""
        bundle = self.amole.remove(internal)
        if bundle is not None:
            unload_bundle(self.adapted, bundle)
        else:
            self.adapted.delete_adapter(internal)

