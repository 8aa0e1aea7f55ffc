"""A FedAMoLE run's models in the adapter pool: each client's own model, and the aggregated pool beside them.

Paper 002 App. D.1.1 scores "client i's local model at round R", and the reference code evaluates each
client's model right after its local training. Training with ``export=local`` (the default) writes it
to ``adapters/clients/<id>/amole``: the pool with that client's last locally trained experts, shared
expert and token projections, under its last assignment; ``adapters/amole`` holds the server's pool
after the last aggregation (the ``export=aggregated`` reading). The names a run serves:

* ``<client>``: the client's own model when the run has its folder (pool entry ``<client>:amole``,
  one bundle per client, pinned like the pool when every one fits the free slots, sharing no expert
  with any other client's); in a run without any such folder (trained with ``export=aggregated``, or
  before they existed) the client's route in the aggregated pool, as before;
* ``amole:<client>``: the client's route in the aggregated pool (entry ``amole``) in a run with them,
  for every client of the pool, also one that has no own model (the last round did not select it);
  ``fedmosaic eval --amole-model aggregated`` scores these.
"""

from __future__ import annotations

from pathlib import Path

from adapters import AdapterError
from adapters.rundir import RunDir
from serving.errors import AdapterLoadFailed
from serving.pool.amole import amole_folder, client_names
from serving.pool.views import RunPool

AGGREGATED = "amole"  # the aggregated pool's entry name (and its clients' prefix beside their own models)
OWN_SUFFIX = ":amole"  # <client>:amole: the entry of a client's own model


def own_model(client: str) -> str:
    """The pool entry name of ``client``'s own AMoLE model."""
    return f"{client}{OWN_SUFFIX}"


def aggregated_target(client: str) -> str:
    """The served name of ``client`` in the aggregated pool while its own model serves ``<client>``."""
    return f"{AGGREGATED}:{client}"


def own_folders(run: RunDir) -> dict[str, Path]:
    """Clients with their own AMoLE folder (``adapters/clients/<id>/amole``) -> that folder, in client order."""
    found = {}
    for client in run.clients():
        folder = amole_folder(run.client_dir(client) / "amole")
        if folder is not None:
            found[client] = folder
    return found


def register_amole(pool: RunPool, run: RunDir) -> tuple[str | None, tuple[str, ...]]:
    """Register the run's AMoLE models in ``pool`` (see the module docstring).

    Returns:
        The aggregated pool's entry name (None: the run has no AMoLE model) and the clients served by
        their own model.

    Raises:
        AdapterLoadFailed: a client's folder is unreadable, does not fit the model, or assigns experts
            to another client than its own.
    """
    if amole_folder(run.amole) is None:
        return None, ()
    own = own_folders(run)
    for client, folder in own.items():
        try:
            names = client_names(folder)
        except AdapterError as exc:
            raise AdapterLoadFailed(str(exc)) from exc
        if names != (client,):
            raise AdapterLoadFailed(f"{folder} must assign experts to its own client {client!r} alone, not {names}")
    # one slot stays for the aggregated pool; beyond the free slots the clients' models are evicted LRU
    # and reloaded from their folders on first use, like local adapters
    pin = len(own) < pool.max_loras - pool.loaded_count()
    for client, folder in own.items():
        pool.load(own_model(client), folder, pinned=pin, replace=True, client_prefix="")
    pool.load(AGGREGATED, run.amole, pinned=True, replace=True, client_prefix=f"{AGGREGATED}:" if own else "")
    return AGGREGATED, tuple(own)
