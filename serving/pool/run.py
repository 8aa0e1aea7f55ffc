"""A training run directory in the adapter pool: ``global``, each ``<client>:local``, the embedding files.

:func:`register_run` is :meth:`serving.pool.pool.AdapterPool.load_run`: it registers the run's
global adapter (pinned), its FedAMoLE models if it has them (:mod:`serving.pool.amole_run`), and every
client's local adapter, and
records each client's embedding files for FedDPA routing (paper 000 section 4.3) without reading
them. Local adapters are loaded while the pool has free slots and registered unloaded beyond that
(:meth:`~serving.pool.pool.AdapterPool.register`; they load on first use like evicted ones), so a
run with 1,000 clients starts without reading 1,000 adapters (``bench/serving/scale.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adapters import AdapterError
from adapters.rundir import RunDir
from serving.errors import AdapterLoadFailed
from serving.pool.amole import client_names
from serving.pool.amole_run import register_amole
from serving.pool.views import RunPool

PROMPT_STYLES = ("alpaca_short", "chat")  # training.data.prompts.PromptStyle; serving/openai/chat_format.py


@dataclass(frozen=True)
class ClientFiles:
    """One client of a run: its local adapter's pool name and its embedding files (paths only)."""

    client: str
    local: str | None
    embeddings_npy: Path | None
    embeddings_faiss: Path | None


@dataclass(frozen=True)
class RunInfo:
    """What :meth:`AdapterPool.load_run` registered from a run directory."""

    root: Path
    method: str
    base_model: str
    inference_weight: float | None
    global_name: str | None
    clients: dict[str, ClientFiles] = field(default_factory=dict)
    amole: str | None = None  # the pool name of the run's AMoLE model (FedAMoLE runs)
    amole_own: tuple[str, ...] = ()  # clients served by their own AMoLE model (``<client>:amole``)
    prompt_style: str = "alpaca_short"  # run.json ``train.prompt_style``: the template chat requests are rendered in


def register_run(pool: RunPool, run_dir: str | Path, pin_global: bool = True) -> RunInfo:
    """Register a training run's adapters in ``pool``; see the module docstring.

    Args:
        pool: the adapter pool.
        run_dir: a run directory (``run.json``, ``adapters/global``, ``adapters/clients/<id>/local``).
        pin_global: pin ``global`` (every FedDPA request uses it).

    Raises:
        AdapterLoadFailed: ``run.json`` is unreadable, or an adapter loaded now does not fit the model.
        PathNotAllowed: the run lies outside the pool's root.
    """
    run = RunDir(pool.resolve(run_dir))
    try:
        config = run.read_config()
    except AdapterError as exc:
        raise AdapterLoadFailed(str(exc)) from exc
    train = config.get("train")
    style = train.get("prompt_style", "alpaca_short") if isinstance(train, dict) else "alpaca_short"  # older runs
    if style not in PROMPT_STYLES:
        raise AdapterLoadFailed(f"{run.run_json}: train.prompt_style {style!r} is not a prompt format this server "
                                f"renders ({', '.join(PROMPT_STYLES)})")
    global_name = amole = None
    if run.global_adapter.is_dir():
        pool.load("global", run.global_adapter, pinned=pin_global, replace=True)
        global_name = "global"
    clients: dict[str, ClientFiles] = {}
    amole, own = register_amole(pool, run)  # each client's own model, and the aggregated pool
    if amole is not None:
        clients.update((c, ClientFiles(c, None, None, None)) for c in client_names(run.amole))
    free = pool.max_loras - pool.loaded_count()
    for client in run.clients():
        local = None
        if run.local_adapter(client).is_dir():
            local = f"{client}:local"
            if free > 0:  # loaded (and so validated) now while slots are free
                pool.load(local, run.local_adapter(client), replace=True)
                free -= 1
            else:
                pool.register(local, run.local_adapter(client), replace=True)
        npy = run.embeddings(client)
        faiss = npy.with_suffix(".faiss")
        clients[client] = ClientFiles(client, local, npy if npy.is_file() else None,
                                      faiss if faiss.is_file() else None)
    weight = config.get("inference_weight")
    return RunInfo(root=run.root, method=str(config.get("method", "")), base_model=str(config.get("model", "")),
                   inference_weight=float(weight) if isinstance(weight, int | float) else None,
                   global_name=global_name, clients=clients, amole=amole, amole_own=own, prompt_style=style)
