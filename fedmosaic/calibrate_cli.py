"""``fedmosaic calibrate RUN_DIR``: (re)build the calibrated FedDPA weighting's files of a trained run.

Training writes each client's calibration (:mod:`routing.calibration`, paper 000 section 4.3 improved)
beside its embedding index when it builds the index. Runs trained before calibrations existed have
only the index; this command adds the calibration from what the run directory already holds: the
stored instance embeddings of each client and the public background prompts (:mod:`routing.background`)
embedded with the run's final global adapter, in the run's prompt template. No client data is read, and
each client's calibration uses its own embeddings only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from adapters import inject, load_adapter, read_adapter_folder
from adapters.rundir import RunDir
from models import load_base_model, settings
from routing.background import background_id
from routing.calibration import calibrate
from routing.embedding import embed_prompts
from training.personalize import background_prompts


def add_calibrate_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic calibrate``."""
    p = sub.add_parser("calibrate", help="(re)build the calibrated FedDPA weighting of a trained run")
    p.add_argument("run_dir", help="a run directory whose clients have embeddings.npy")
    p.add_argument("--model", default=None, help="base model (default: run.json's)")
    p.add_argument("--statistic", choices=["centroid", "knn"], default="centroid",
                   help="centroid: mean centred cosine over every instance (default); knn: over the k nearest")
    p.add_argument("--k", type=int, default=5, help="neighbours averaged by --statistic knn")
    p.add_argument("--background-quantile", type=float, default=1.0,
                   help="quantile of the background prompts' scores that maps to a = 0 (1: the highest)")
    p.add_argument("--dtype", choices=settings.DTYPES, default=None)
    p.add_argument("--device", type=settings.device_option, default=None, help=settings.DEVICE_HELP)
    return p


def calibrate_run(run_dir: str | Path, model: str | None = None, statistic: str = "centroid", k: int = 5,
                  background_quantile: float = 1.0, dtype: str | None = None, device: str | None = None
                  ) -> dict[str, Any]:
    """Write ``embeddings.calibration.json`` for every client of ``run_dir`` that has an embedding index.

    Returns:
        ``{client: {"own": o, "background": b, "path": file}}``.

    Raises:
        ValueError: the run has no global adapter or no client with an embedding index.
    """
    run = RunDir(Path(run_dir))
    cfg = run.read_config()
    clients = [c for c in run.clients() if run.embeddings(c).is_file()]
    if not clients:
        raise ValueError(f"{run.root} has no embedding index (adapters/clients/<id>/embeddings.npy): "
                         "only FedDPA runs are weighted instance-wise")
    if not (run.global_adapter / "adapter_config.json").is_file():
        raise ValueError(f"{run.root} has no global adapter ({run.global_adapter})")
    loaded = load_base_model(model or cfg.get("model", "smollm2"), dtype=dtype, device=device)  # type: ignore[arg-type]
    lora, _, _ = read_adapter_folder(run.global_adapter)
    adapted = inject(loaded.model, lora.target_modules)
    load_adapter(adapted, run.global_adapter, "global", check_base=False)
    style = str((cfg.get("train") or {}).get("prompt_style", "alpaca_short"))
    prompts = background_prompts(loaded.tokenizer, style)
    background = embed_prompts(loaded.model, adapted, loaded.tokenizer, prompts, ("global",), autocast=loaded.autocast)
    out: dict[str, Any] = {}
    for client in clients:
        folder = run.client_dir(client)
        vectors = np.load(run.embeddings(client), allow_pickle=False)
        cal = calibrate(vectors, background, statistic, k, background_quantile, background_id())  # type: ignore[arg-type]
        out[client] = {"own": cal.own, "background": cal.background, "path": str(cal.save(folder))}
    return out


def run_calibrate(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic calibrate``: prints one JSON object (per client: references and file)."""
    if args.k < 1 or not 0.0 <= args.background_quantile <= 1.0:
        raise SystemExit("fedmosaic calibrate: --k must be >= 1 and --background-quantile in [0, 1]")
    try:
        result = calibrate_run(args.run_dir, args.model, args.statistic, args.k, args.background_quantile,
                               args.dtype, args.device)
    except ValueError as exc:
        raise SystemExit(f"fedmosaic calibrate: {exc}") from exc
    print(json.dumps(result, indent=2))
    return 0
