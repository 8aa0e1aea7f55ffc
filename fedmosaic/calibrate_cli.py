"""``fedmosaic calibrate RUN_DIR``: (re)build the calibrated FedDPA weighting's files of a trained run.

Training writes each client's calibration (:mod:`routing.calibration`, paper 000 section 4.3 improved)
beside its embedding index when it builds the index. Runs trained before calibrations existed have
only the index; this command adds the calibration from what the run directory already holds: the
stored instance embeddings of each client and the public background prompts (:mod:`routing.background`)
embedded with the run's final global adapter, in the run's prompt template. No client data is read, and
each client's calibration uses its own embeddings only.

``--feddpa-embedding mean`` (paper 000 Table 10's average-token embedding) needs the index itself pooled
that way: a client whose index was pooled otherwise (``embeddings.kind.json``; none: last token) gets it
rebuilt from its training instances, re-read from the run's data set as ``run.json`` records it and
embedded with the final global adapter, then calibrated; ``--rebuild-index`` rebuilds it whatever its
pooling. Each client's index is built from that client's own instances only. A client's gate (the check
of its local adapter on held-out examples at the end of training, :mod:`training.federation.local_gate`) is kept;
``--gate`` checks every client's local adapter again on its held-out examples (a run trained with
``--hold-out``, before the check existed or under another rule; ``--gate-alpha`` sets the sign test's level).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from adapters import inject, load_adapter, read_adapter_folder
from adapters.rundir import RunDir
from models import load_base_model, settings
from routing.background import background_id
from routing.base import Pooling, RoutingError
from routing.cache import EmbeddingIndex, index_pooling
from routing.calibration import CALIBRATION_FILE, STATISTICS, Calibration, Statistic, calibrate
from routing.embedding import POOLINGS, embed_prompts
from training.data import load_run_dataset
from training.federation.local_gate import ALPHA, check_local
from training.federation.personalize import background_prompts, instance_prompts, write_index


def add_calibrate_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic calibrate``."""
    p = sub.add_parser("calibrate", help="(re)build the calibrated FedDPA weighting of a trained run")
    p.add_argument("run_dir", help="a run directory whose clients have embeddings.npy")
    p.add_argument("--model", default=None, help="base model (default: run.json's)")
    p.add_argument("--statistic", choices=list(STATISTICS), default="mahalanobis",
                   help="mahalanobis: distance to the instances' shrunk Gaussian (default); centroid: mean centred "
                        "cosine over every instance; knn: over the k nearest")
    p.add_argument("--k", type=int, default=5, help="neighbours averaged by --statistic knn")
    p.add_argument("--background-quantile", type=float, default=None,
                   help="quantile of the background prompts' scores at or below which a = 0 (1: the highest; "
                        "default: mahalanobis chooses it with its own quantile per client on a validation split of "
                        "its training prompts, routing/selection.py; 1 for centroid and knn)")
    p.add_argument("--feddpa-embedding", choices=POOLINGS, default=None,
                   help="pool the index's states as the last token or the mean over the prompt's tokens (paper 000 "
                        "Table 10); an index pooled otherwise is rebuilt from the run's data (default: keep each "
                        "client's)")
    p.add_argument("--rebuild-index", action="store_true",
                   help="re-embed every client's training instances even when its index is pooled as asked")
    p.add_argument("--gate", action="store_true",
                   help="check every client's local adapter again on its held-out examples (a run trained with "
                        "--hold-out): its gain is 1 only if the mix at lambda answers them better (sign test)")
    p.add_argument("--gate-alpha", type=float, default=None,
                   help=f"the gate's sign-test level, with --gate (default {ALPHA})")
    p.add_argument("--dtype", choices=settings.DTYPES, default=None)
    p.add_argument("--device", type=settings.device_option, default=None, help=settings.DEVICE_HELP)
    return p


def calibrate_run(run_dir: str | Path, model: str | None = None, statistic: Statistic = "mahalanobis", k: int = 5,
                  background_quantile: float | None = None, dtype: settings.DType | None = None,
                  device: str | None = None, embedding: Pooling | None = None, rebuild: bool = False,
                  gate: bool = False, alpha: float = ALPHA) -> dict[str, Any]:
    """Write ``embeddings.calibration.json`` for every client of ``run_dir`` that has an embedding index.

    Args:
        run_dir: the run directory.
        model: base model (default: ``run.json``'s).
        statistic: ``mahalanobis``, ``centroid`` or ``knn`` (``routing.calibration``).
        k: neighbours of ``knn``.
        background_quantile: the background scores' quantile that maps to ``a = 0`` (None: chosen per client
            on a validation split of its own instances for ``mahalanobis``, :mod:`routing.selection`).
        dtype: compute dtype.
        device: where the model runs.
        embedding: ``last`` or ``mean``: rebuild every index pooled otherwise (None: keep each client's).
        rebuild: rebuild every index from the client's training instances.
        gate: check each client's local adapter again on its held-out examples (``training.federation.local_gate``).
        alpha: the gate's sign-test level.

    Returns:
        ``{client: {"own": o, "background": b, "path": file, "embedding": pooling, "rebuilt": bool, "gain": g}}``
        (with ``gate``, also ``"gate"``: what the check measured).

    Raises:
        ValueError: the run has no global adapter or no client with an embedding index; with ``gate``, the
            run held no examples out, has no local weight, or a client has no local adapter.
        DataError: an index must be rebuilt but the run's data set cannot be read or lacks the client.
    """
    run = RunDir(Path(run_dir))
    cfg = run.read_config()
    clients = [c for c in run.clients() if run.embeddings(c).is_file()]
    if not clients:
        raise ValueError(f"{run.root} has no embedding index (adapters/clients/<id>/embeddings.npy): "
                         "only FedDPA runs are weighted instance-wise")
    if not (run.global_adapter / "adapter_config.json").is_file():
        raise ValueError(f"{run.root} has no global adapter ({run.global_adapter})")
    stored = {c: index_pooling(run.client_dir(c)) for c in clients}
    wanted: dict[str, Pooling] = {c: embedding or stored[c] for c in clients}
    redo = {c for c in clients if rebuild or wanted[c] != stored[c]}
    lambda_ = gate_weight(run, cfg, clients) if gate else 0.0
    # the data set is read only when an index is re-embedded or a gate checked, before the model loads (a bad
    # spec fails first)
    data = {cd.client_id: cd for cd in load_run_dataset(cfg, run_dir=run.root).clients} if redo or gate else {}
    lost = sorted((set(clients) if gate else redo) - set(data))
    if lost:
        raise ValueError(f"the data set of {run.root} names no clients {lost}: their index cannot be rebuilt")
    loaded = load_base_model(model or cfg.get("model", "smollm2"), dtype=dtype, device=device)
    lora, _, _ = read_adapter_folder(run.global_adapter)
    adapted = inject(loaded.model, lora.target_modules)
    load_adapter(adapted, run.global_adapter, "global", check_base=False)
    style = str((cfg.get("train") or {}).get("prompt_style", "alpaca_short"))

    def embed(prompts: list[str], pooling: Pooling) -> np.ndarray:
        return embed_prompts(loaded.model, adapted, loaded.tokenizer, prompts, ("global",), autocast=loaded.autocast,
                             pooling=pooling)

    backgrounds: dict[str, np.ndarray] = {}  # one embedding of the public prompts per pooling used
    out: dict[str, Any] = {}
    for client in clients:
        folder, pooling = run.client_dir(client), wanted[client]
        if pooling not in backgrounds:
            backgrounds[pooling] = embed(background_prompts(loaded.tokenizer, style), pooling)
        vectors = embed(instance_prompts(data[client], loaded.tokenizer, style), pooling) if client in redo \
            else np.load(run.embeddings(client), allow_pickle=False)
        cal = calibrate(vectors, backgrounds[pooling], statistic, k, background_quantile,
                        background_id())
        if gate:
            load_adapter(adapted, run.local_adapter(client), "local", check_base=False, replace=True)
            verdict = check_local(loaded, adapted, style, data[client].validation, lambda_, alpha)
            cal = dataclasses.replace(cal, gain=verdict.gain, gate=verdict.asdict())
        else:
            cal = kept_gate(cal, folder)
        if client in redo:
            write_index(EmbeddingIndex(vectors, calibration=cal, pooling=pooling), folder)
        else:
            cal.save(folder)
        out[client] = {"own": cal.own, "background": cal.background, "path": str(folder / CALIBRATION_FILE),
                       "embedding": pooling, "rebuilt": client in redo, "gain": cal.gain}
        if gate:
            out[client]["gate"] = cal.gate
    return out


def gate_weight(run: RunDir, cfg: dict[str, Any], clients: list[str]) -> float:
    """The local weight ``--gate`` checks (``run.json``'s ``inference_weight``, capped at 1).

    Raises:
        ValueError: the run held no examples out, its local weight is 0, or a client has no local adapter.
    """
    if not (cfg.get("data_options") or {}).get("hold_out"):
        raise ValueError(f"{run.root} was trained without held-out examples: --gate needs a run trained with "
                         "`fedmosaic train --hold-out SHARE`")
    weight = float(cfg.get("inference_weight") or 0.0)
    if weight <= 0.0:
        raise ValueError(f"{run.root} serves its clients' local adapters at weight {weight}: there is nothing to gate")
    missing = [c for c in clients if not (run.local_adapter(c) / "adapter_config.json").is_file()]
    if missing:
        raise ValueError(f"{run.root} has no local adapter for clients {missing}: --gate checks local adapters")
    return min(weight, 1.0)


def kept_gate(cal: Calibration, folder: Path) -> Calibration:
    """``cal`` with the gain and gate of ``folder``'s current calibration, if that one holds a gate.

    The gate is a verdict on the client's adapters from its held-out examples (``training.federation.local_gate``),
    not on its index: rebuilding the calibration or the index keeps it. An unreadable old file has none.
    """
    try:
        old = Calibration.load(folder)
    except RoutingError:
        return cal
    return dataclasses.replace(cal, gain=old.gain, gate=old.gate) if old is not None and old.gate else cal


def run_calibrate(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic calibrate``: prints one JSON object (per client: references and file)."""
    if args.k < 1 or (args.background_quantile is not None and not 0.0 <= args.background_quantile <= 1.0):
        raise SystemExit("fedmosaic calibrate: --k must be >= 1 and --background-quantile in [0, 1]")
    if args.gate_alpha is not None and not args.gate:  # a level without the check would be silently ignored
        raise SystemExit("fedmosaic calibrate: --gate-alpha sets the level of --gate's sign test; add --gate")
    alpha = ALPHA if args.gate_alpha is None else args.gate_alpha
    if not 0.0 < alpha < 1.0:
        raise SystemExit(f"fedmosaic calibrate: --gate-alpha must be in (0, 1), got {alpha}")
    try:
        result = calibrate_run(args.run_dir, args.model, args.statistic, args.k, args.background_quantile,
                               args.dtype, args.device, args.feddpa_embedding, args.rebuild_index, args.gate,
                               alpha)
    except ValueError as exc:  # DataError and AdapterError included
        raise SystemExit(f"fedmosaic calibrate: {exc}") from exc
    print(json.dumps(result, indent=2))
    return 0
