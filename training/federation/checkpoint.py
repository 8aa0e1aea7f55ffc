"""Per-round checkpoints inside a run directory, written so that an interrupted run resumes exactly.

``rounds/<r>/`` holds the server state (``server.safetensors``, the exact tensors, plus ``global/`` as
a PEFT folder for evaluation), the strategy's extra state, every client's private tensors
(``clients/<id>/<name>.safetensors``), the transport's state (``transport.json``: what a Flower server
must remember about its nodes) and, written last, ``COMPLETE``: a manifest naming every other file with
its size and SHA-256 as read back from disk. Every file is written durably (:mod:`training.federation.durable`:
temporary name, fsync, rename, fsync of the folder). A round counts as complete only when every file its
manifest names reads back as written, so neither a crash mid-checkpoint nor a file torn after the fact
(a power loss without fsync, a bad disk) yields a resume point; :func:`last_complete` falls back to the
newest round that verifies. (A ``COMPLETE`` holding ``ok`` is a checkpoint from before manifests.)

A strategy's state (:meth:`training.protocol.Strategy.state_dict`) is JSON data that may hold torch
tensors at any depth. The tensors go to ``strategy.safetensors`` (exact dtype and bits, no text
encoding); ``strategy.json`` holds the rest with each tensor replaced by ``{"__tensor__": key}``. The
key is the tensor's path in the nested structure: the dict keys and list indices from the top, each
escaped as in a JSON pointer (RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``) and joined by ``/``, e.g.
``history/3`` or ``learners/0.stack.mixers.0.A_log``. A state without tensors is written exactly as
before (``json.dumps`` of the dict, no ``strategy.safetensors``). A round also counts as complete only
if every tensor its ``strategy.json`` refers to is readable from a fully written ``strategy.safetensors``.

Strategy tensors can be large (pFedSeq keeps L rounds of every client's update and its learners: about
160 MB per round at SmolLM2's adapter size), while a resume needs only the last complete round's.
:func:`prune_strategy_state` deletes the ``strategy.safetensors`` of older rounds once a newer round is
complete and leaves a ``STRATEGY_PRUNED`` marker, so such a round says why it is no longer a resume point;
its adapters, client states and ``strategy.json`` stay for evaluation and analysis.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from adapters import LoraConfig, write_adapter_folder
from adapters.rundir import RunDir, check_client_id
from training.federation import durable
from training.state import StateDict

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
PRUNED = "STRATEGY_PRUNED"
STRATEGY_JSON = "strategy.json"
STRATEGY_TENSORS = "strategy.safetensors"
TENSOR_REF = "__tensor__"
TRANSPORT_JSON = "transport.json"


def _save(path: Path, state: StateDict) -> None:
    durable.save_tensors(path, state)


def _escape(part: object) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Separate the tensors of a nested strategy state from its JSON data.

    Args:
        state: JSON data (dicts, lists, tuples, scalars) with torch tensors at any depth.

    Returns:
        The same structure with each tensor replaced by ``{"__tensor__": key}``, and the tensors by key
        (detached CPU copies where needed; tensors sharing storage are cloned so safetensors takes them).

    Raises:
        ValueError: a dict uses the reserved key ``"__tensor__"``, or two paths escape to the same key.
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            key = "/".join(path)
            if key in tensors:
                raise ValueError(f"two strategy state entries map to the tensor key {key!r}")
            t = node.detach().cpu().contiguous()
            storage = (str(t.device), t.untyped_storage().data_ptr())
            if storage in storages and t.numel():
                t = t.clone()  # safetensors refuses tensors that share memory (views, tied weights)
            storages.add(storage)
            tensors[key] = t
            return {TENSOR_REF: key}
        if isinstance(node, dict):
            if TENSOR_REF in node:
                raise ValueError(f"strategy state at {'/'.join(path) or '<top>'} uses the reserved key {TENSOR_REF!r}")
            return {k: walk(v, (*path, _escape(k))) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [walk(v, (*path, str(i))) for i, v in enumerate(node)]
        return node

    skeleton = walk(state, ())
    return (skeleton if tensors else state), tensors


def _refs(node: Any) -> list[str]:
    """Every tensor key that a ``strategy.json`` structure refers to."""
    if isinstance(node, dict):
        if set(node) == {TENSOR_REF}:
            return [str(node[TENSOR_REF])]
        return [k for v in node.values() for k in _refs(v)]
    if isinstance(node, list):
        return [k for v in node for k in _refs(v)]
    return []


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`: put each referenced tensor back in place.

    Raises:
        KeyError: a reference names a tensor that ``tensors`` lacks.
    """
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_REF}:
            key = str(skeleton[TENSOR_REF])
            if key not in tensors:
                raise KeyError(f"strategy state refers to tensor {key!r}, missing from {STRATEGY_TENSORS}")
            return tensors[key]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    return skeleton


def save_round(
    run: RunDir, round_idx: int, server: StateDict, strategy: dict[str, Any], private: dict[str, dict[str, StateDict]],
    lora: LoraConfig, base_model: str, peft_global: bool = True, transport: dict[str, Any] | None = None,
) -> Path:
    """Durably write round ``round_idx``'s checkpoint, then its ``COMPLETE`` manifest.

    Args:
        run: the run directory.
        round_idx: the round just aggregated.
        server: the server tensors after aggregation.
        strategy: ``strategy.state_dict()``: JSON data, tensors allowed at any depth (see the module docstring).
        private: each client's private tensors by name.
        lora: the LoRA config of the PEFT folder ``global/``.
        base_model: the base model name recorded in that folder.
        peft_global: write ``global/`` (methods with their own export skip it).
        transport: the transport's JSON state (:meth:`training.federation.rounds.Transport.state_dict`).

    Returns:
        The round's folder.
    """
    folder = run.round_dir(round_idx)
    if folder.exists():
        shutil.rmtree(folder)  # an incomplete earlier attempt at this round
    folder.mkdir(parents=True)
    durable.fsync_dir(folder.parent)
    _save(folder / "server.safetensors", server)
    if server and peft_global:
        durable.write_folder(folder / "global", lambda tmp: write_adapter_folder(tmp, lora, server, base_model))
    skeleton, tensors = split_tensors(strategy)
    if tensors:
        _save(folder / STRATEGY_TENSORS, tensors)
    durable.write_text(folder / STRATEGY_JSON, json.dumps(skeleton))
    durable.write_json(folder / TRANSPORT_JSON, transport or {})
    for client, named in private.items():
        for name, state in named.items():
            _save(folder / "clients" / check_client_id(client) / f"{name}.safetensors", state)
    # last, and read back from disk: the round counts only once everything above is in place as written
    written = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(durable.TMP_PREFIX)]
    durable.write_manifest(folder / COMPLETE, folder, written)
    return folder


def _problem(folder: Path, deep: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when it is.

    Args:
        folder: a round's folder.
        deep: check every file's SHA-256 against the manifest (False: presence and sizes only).
    """
    if not (folder / COMPLETE).is_file():
        return f"no {COMPLETE} marker"
    if (folder / PRUNED).is_file():
        return f"its {STRATEGY_TENSORS} was pruned once a later round was complete (keep_strategy)"
    try:
        marker = (folder / COMPLETE).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return f"unreadable {COMPLETE} ({exc})"
    if marker.strip() != "ok":  # "ok": a checkpoint from before manifests, checked as it always was
        try:
            manifest = json.loads(marker)
        except ValueError:
            return f"torn {COMPLETE} manifest"
        problem = durable.manifest_problem(folder, manifest if isinstance(manifest, dict) else {}, deep)
        if problem is not None:
            return problem
    try:
        refs = _refs(json.loads((folder / STRATEGY_JSON).read_text()))
    except (OSError, ValueError) as exc:
        return f"unreadable {STRATEGY_JSON} ({exc})"
    if not refs:
        return None
    try:
        with safe_open(str(folder / STRATEGY_TENSORS), "pt") as f:
            missing = sorted(set(refs) - set(f.keys()))
    except (OSError, SafetensorError) as exc:  # absent, or cut short: safetensors checks the file covers its header
        return f"unreadable {STRATEGY_TENSORS} ({exc})"
    return f"{STRATEGY_TENSORS} lacks {missing[:3]}" if missing else None


def last_complete(run: RunDir) -> int | None:
    """The newest round whose checkpoint verifies (every file reads back as written), or None.

    Newer rounds that do not verify are skipped with a warning naming what is wrong: the run resumes
    from an older round and computes the skipped ones again.
    """
    for r in reversed(run.rounds()):
        problem = _problem(run.round_dir(r))
        if problem is None:
            return r
        logger.warning("round %d of %s is not a resume point: %s", r, run.root, problem)
    return None


def prune_strategy_state(run: RunDir, keep: int) -> list[int]:
    """Delete the strategy tensors of all complete rounds but the last ``keep`` (0 keeps everything).

    Only rounds older than the newest complete round are touched, so a resume point always remains.

    Args:
        run: the run directory.
        keep: how many of the newest complete rounds keep their ``strategy.safetensors``.

    Returns:
        The rounds pruned by this call.
    """
    if keep < 0:
        raise ValueError(f"keep_strategy must be >= 0, got {keep}")
    if keep == 0:
        return []
    complete = [r for r in run.rounds() if _problem(run.round_dir(r), deep=False) is None]
    pruned = []
    for r in complete[:-keep]:
        folder = run.round_dir(r)
        if (folder / STRATEGY_TENSORS).is_file():
            durable.write_text(folder / PRUNED, "strategy tensors deleted; a later round is the resume point\n")
            (folder / STRATEGY_TENSORS).unlink()
            durable.fsync_dir(folder)
            pruned.append(r)
    return pruned


def load_round(run: RunDir, round_idx: int) -> tuple[StateDict, dict[str, Any], dict[str, dict[str, StateDict]]]:
    """Read back (server state, strategy state with its tensors in place, private states by client and name).

    The files are checked for presence and size here; :func:`last_complete` compares their contents.

    Raises:
        FileNotFoundError: the round has no complete checkpoint (the message says what is missing).
    """
    folder = run.round_dir(round_idx)
    problem = _problem(folder, deep=False)
    if problem is not None:
        raise FileNotFoundError(f"round {round_idx} has no complete checkpoint in {folder}: {problem}")
    server = load_file(str(folder / "server.safetensors"))
    strategy = json.loads((folder / STRATEGY_JSON).read_text())
    if _refs(strategy):
        strategy = join_tensors(strategy, load_file(str(folder / STRATEGY_TENSORS)))
    private: dict[str, dict[str, StateDict]] = {}
    clients = folder / "clients"
    if clients.is_dir():
        for cdir in clients.iterdir():
            private[cdir.name] = {p.stem: load_file(str(p)) for p in cdir.glob("*.safetensors")}
    return server, strategy, private


def load_transport_state(run: RunDir, round_idx: int) -> dict[str, Any]:
    """The transport's state saved with round ``round_idx`` (empty for checkpoints written before it was)."""
    path = run.round_dir(round_idx) / TRANSPORT_JSON
    return json.loads(path.read_text()) if path.is_file() else {}
