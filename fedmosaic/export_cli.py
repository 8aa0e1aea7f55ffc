"""``fedmosaic export RUN_DIR --client ID --out FOLDER``: one client's adapter as a plain PEFT folder.

What a client's requests get at a fixed weight, written as one LoRA any PEFT runtime loads
(``PeftModel.from_pretrained``, vLLM, ...): a FedDPA client (global and local adapter) is
``(1 - a) * global + a * local`` at ``a`` = ``--weight``, else the run's ``inference_weight``
(:func:`adapters.export.concat_states`: exact, rank ``r_g + r_l``; the instance-wise weighting a server applies
per request has no single-adapter form); a client with only a local adapter is that adapter; a method
without local adapters exports its global one. The adapters may target different modules and have
different ranks: the export covers their union. A FedAMoLE run routes every token over experts and has
no single-LoRA form: it is refused. Only the adapter files are read; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adapters import AdapterError, read_adapter_folder
from adapters.export import concat_states
from adapters.io import write_adapter_folder
from adapters.rundir import RunDir, check_client_id


def add_export_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic export``."""
    p = sub.add_parser("export", help="write one client's adapter of a run as a PEFT folder")
    p.add_argument("run_dir", help="a training run directory (run.json, adapters/)")
    p.add_argument("--client", required=True, help="the client whose adapter to export")
    p.add_argument("--out", required=True, help="the PEFT folder to write (adapter_config.json, safetensors)")
    p.add_argument("--weight", type=float, default=None,
                   help="FedDPA: the local adapter's weight a in [0, 1] (default: run.json's inference_weight)")
    return p


def export_client(run_dir: str | Path, client: str, out: str | Path, weight: float | None = None) -> dict[str, object]:
    """Write ``client``'s adapter of the run at ``run_dir`` to ``out``; return what was written.

    Raises:
        AdapterError: no such run or client, a FedAMoLE run, a FedDPA run without a weight, or a weight
            outside [0, 1].
    """
    run = RunDir(Path(run_dir))
    config = run.read_config()
    check_client_id(client)
    if run.amole.is_dir():
        raise AdapterError(f"{run.root} is a FedAMoLE run: its clients route every token over experts, which no "
                           "single LoRA adapter expresses; serve it with `fedmosaic serve`")
    local = run.local_adapter(client)
    has_local, has_global = local.is_dir(), run.global_adapter.is_dir()
    if not has_local and client not in run.clients():
        raise AdapterError(f"{run.root} has no client {client!r}; its clients: {run.clients()}")
    if weight is None and has_local and has_global:
        stored = config.get("inference_weight")
        if not isinstance(stored, int | float):
            raise AdapterError(f"{run.run_json} records no inference_weight: give --weight")
        weight = float(stored)
    if weight is not None and not 0.0 <= weight <= 1.0:
        raise AdapterError(f"--weight must be in [0, 1], got {weight}")
    mixture = ([(run.global_adapter, 1.0 - float(weight or 0.0)), (local, float(weight or 0.0))]
               if has_local and has_global else [(local, 1.0)] if has_local else [(run.global_adapter, 1.0)])
    read = [(read_adapter_folder(folder), w) for folder, w in mixture if w != 0.0]
    lora, tensors = concat_states([(cfg, state, w) for (cfg, state, _), w in read])
    base = next((raw.get("base_model_name_or_path") for (_, _, raw), _ in read), None)
    write_adapter_folder(out, lora, tensors, str(base) if base else None)
    return {"client": client, "out": str(out), "rank": lora.r, "weights": {f.name: w for f, w in mixture},
            "modules": len(tensors) // 2}


def run_export(args: argparse.Namespace) -> int:
    """Export and print a JSON summary."""
    try:
        summary = export_client(args.run_dir, args.client, args.out, args.weight)
    except AdapterError as exc:
        raise SystemExit(f"fedmosaic export: {exc}") from exc
    print(json.dumps(summary))
    return 0
