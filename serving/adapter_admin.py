"""Adapters loaded and unloaded while serving (vLLM's ``/v1/load_lora_adapter``), with the server's rules.

The pool (:mod:`serving.pool.pool`) places adapters; these functions decide what a runtime caller
may ask of it, for the HTTP routes and any other operator tool:

* loading needs an adapter root: with none (no run directory, no ``--adapter-root``, no adapters on
  the command line) a runtime load could read any folder on disk, so it is refused;
* a runtime load never takes a name that already means something else: the base model, a served
  client (FedDPA ``<client>`` or AMoLE), the name space of the run (``global`` and every run client's
  ``<client>``, ``<client>:local`` and ``<client>:amole``), or a ``<x>:local`` that would turn an adapter ``x`` into a
  client. Reloading a registered adapter in place (``replace``) is allowed: that is a new version of
  the same thing, not a new meaning for the name;
* a pinned adapter is unloaded only with ``force`` (every FedDPA client needs the pinned ``global``),
  and, on a server with keys, only by an admin key (:func:`needs_admin_key`), even where unbound user keys
  act as admins (a server without keys has one user, its operator).
"""

from __future__ import annotations

from pathlib import Path

from adapters.rundir import RunDir
from routing.base import GLOBAL, LOCAL_SUFFIX, local_name
from serving.errors import NameReserved, PathNotAllowed
from serving.pool import AdapterInfo
from serving.pool.amole import amole_folder, client_names
from serving.pool.amole_run import OWN_SUFFIX, own_model
from serving.stack import ServingStack


def run_folder(stack: ServingStack, name: str) -> Path | None:
    """The served run's own folder for ``name`` (``global``, ``<client>:local``, its AMoLE model), or None."""
    run = stack.run_info
    if run is None:
        return None
    folders = RunDir(run.root)
    if name == GLOBAL:
        return folders.global_adapter.resolve()
    if run.amole is not None and name == run.amole:
        return amole_folder(folders.amole.resolve())
    own = name[: -len(OWN_SUFFIX)] if name.endswith(OWN_SUFFIX) else None
    if own is not None and own in run.amole_own:  # a client's own AMoLE model (serving.pool.amole_run)
        return amole_folder(folders.client_dir(own).resolve() / "amole")
    client = name[: -len(LOCAL_SUFFIX)] if name.endswith(LOCAL_SUFFIX) else None
    if client is not None and client in run.clients:
        return folders.local_adapter(client).resolve()
    return None


def reserved(stack: ServingStack, name: str, replace: bool, folder: Path | None = None) -> str | None:
    """Why a runtime load of ``folder`` may not use ``name`` (None when it may).

    A name of the run (``global``, a run client's ``<client>:local``, its AMoLE model) may be loaded
    anew only from the run's own folder for it: that restores what the run serves.
    """
    resolver, pool, run = stack.resolver, stack.pool, stack.run_info
    run_clients = set(run.clients) if run is not None else set()
    if name == resolver.base_name:
        return "it is the base model's name"
    if name in run_clients or name in resolver.clients():
        return "it is the name of a served client"
    registered = name in pool or name in pool.amole_models()
    if replace and registered:
        return None  # an in-place reload: a new version under the same meaning
    own = run_folder(stack, name)
    if own is not None and folder is not None:
        amole_names = (run.amole, *map(own_model, run.amole_own)) if run is not None else ()
        given = amole_folder(folder) if name in amole_names else folder
        if given == own:
            return None  # the run's own adapter, restored
    if name == GLOBAL or any(name in (local_name(c), own_model(c)) for c in run_clients):
        return "the run's adapters own it (load it from the run's own folder to restore it)"
    if name.endswith(LOCAL_SUFFIX) and name[: -len(LOCAL_SUFFIX)] in (resolver.base_name, *pool.names()):
        return f"it would make {name[: -len(LOCAL_SUFFIX)]!r} both an adapter and a client"
    return None


def load(stack: ServingStack, name: str, path: str | Path, pinned: bool = False, replace: bool = False
         ) -> AdapterInfo:
    """Load (or with ``replace`` reload as a new version) the adapter folder ``path`` as ``name``.

    Raises:
        PathNotAllowed: the server has no adapter root, or ``path`` resolves outside it.
        NameReserved: ``name`` (or a client of the AMoLE model at ``path``) is reserved (module docstring).
        AdapterExists, AdapterLoadFailed, NoFreeSlot: from the pool.
    """
    pool = stack.pool
    if pool.root is None:
        raise PathNotAllowed("runtime adapter loading needs an adapter root: start the server with "
                             "--adapter-root DIR (or serve a run directory); adapters load only from inside it")
    folder = pool.resolve(path)
    why = reserved(stack, name, replace, folder)
    if why is not None:
        raise NameReserved(f"the name {name!r} cannot be loaded at run time: {why}")
    amole = amole_folder(folder)
    restoring = amole is not None and amole == run_folder(stack, name)
    taken = {stack.resolver.base_name, GLOBAL, *stack.resolver.clients(),
             *(stack.run_info.clients if stack.run_info is not None and not restoring else ())}
    prefix = pool.client_prefix(name)  # a restored aggregated pool serves the names it served
    for client in (prefix + c for c in client_names(amole)) if amole is not None else ():
        if pool.amole_model_of(client) != name and (client in taken or client in pool):
            raise NameReserved(f"the AMoLE model at {str(path)!r} serves a client {client!r} whose name is taken")
    return pool.load(name, path, pinned, replace)


def needs_admin_key(stack: ServingStack, name: str) -> bool:
    """True when unloading ``name`` takes an admin key: ``global`` or any pinned adapter (every tenant needs them)."""
    return name == GLOBAL or any(info.pinned for info in stack.pool.info(name))


def unload(stack: ServingStack, name: str, force: bool = False) -> None:
    """Unload ``name``; a pinned adapter only with ``force`` (raises AdapterPinned, AdapterNotFound)."""
    stack.pool.unload(name, force=force)
