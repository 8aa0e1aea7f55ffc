"""``fedmosaic serve`` and ``fedmosaic batch``: argv -> settings -> the API server or the batch runner.

Sources are training run directories (``run.json`` + ``adapters/``) or adapter folders given as
``name=folder`` (a bare folder is served under its folder name). ``serve`` runs the OpenAI-compatible
HTTP API on the PyTorch engine; ``batch`` answers an OpenAI batch file offline (:mod:`serving.batch`)
on the PyTorch engine or, with ``--backend vllm`` (or ``auto`` on a CUDA machine with vllm), on the
optional vLLM backend (:mod:`serving.vllm_backend`). ``fedmosaic/cli.py`` registers the functions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from models.settings import DEVICE_HELP, device_option, resolve_device
from serving.settings import ServeSettings


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="*", help="RUN_DIR (with run.json) or adapter folders as name=folder")
    p.add_argument("--model", default="smollm2", help="base model: smollm2, tiny, or an HF folder")
    p.add_argument("--served-model-name", default=None, help="name of the base model in the API")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "autocast-bf16"])
    p.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    p.add_argument("--max-loras", type=int, default=16, help="adapters loaded at once (LRU beyond)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens-limit", type=int, default=1024)
    p.add_argument("--adapter-root", default=None, help="runtime-loaded adapters must lie inside it")
    p.add_argument("--feddpa-routing", choices=["instance", "fixed"], default="instance",
                   help="<client> targets: instance-wise weights from the run's embeddings, or its fixed weight")


def add_serve_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible server for the base model and its adapters")
    _add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], help="bearer key for /v1/* (repeatable)")
    p.add_argument("--no-runtime-lora", action="store_true", help="disable /v1/load_lora_adapter and unload")
    return p


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Translate parsed options into settings (one run directory at most)."""
    runs = [s for s in args.sources if "=" not in s and (Path(s) / "run.json").is_file()]
    if len(runs) > 1:
        raise SystemExit("fedmosaic: give one run directory at most")
    adapters = [s if "=" in s else f"{Path(s).resolve().name}={s}" for s in args.sources if s not in runs]
    extra = {"host": args.host, "port": args.port, "api_keys": args.api_key,
             "allow_runtime_lora": not args.no_runtime_lora} if hasattr(args, "host") else {}  # serve only
    return ServeSettings(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        max_loras=args.max_loras,
        max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, max_tokens_limit=args.max_tokens_limit,
        run_dir=Path(runs[0]) if runs else None, adapters=adapters,
        adapter_root=Path(args.adapter_root) if args.adapter_root else None, feddpa_routing=args.feddpa_routing,
        **extra)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from serving.api import create_app

    settings = settings_from_args(args)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


def add_batch_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``batch`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser("batch", help="answer an OpenAI batch file (JSONL) offline, with continuous batching")
    p.add_argument("-i", "--input", required=True, help="batch file: OpenAI batch lines or bare request bodies")
    p.add_argument("-o", "--output", required=True, help="results (OpenAI batch output format; resumable)")
    _add_model_arguments(p)
    p.add_argument("--default-max-tokens", type=int, default=128, help="max_tokens of chat lines that set none")
    p.add_argument("--backend", choices=["auto", "torch", "vllm"], default="auto",
                   help="auto: vLLM when it imports and the device is CUDA, else the PyTorch engine")
    p.add_argument("--levels", type=int, default=11, help="vLLM backend: quantisation levels of the FedDPA weight")
    p.add_argument("--export-dir", default=None, help="vLLM backend: where (client, level) adapters are written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_batch(args: argparse.Namespace) -> int:
    """Answer the batch file; print a JSON summary. Exit status 0 even when some lines failed."""
    from serving.api.app import stack_config
    from serving.batch import BatchConfig, run_batch
    from serving.stack import build_stack
    from serving.vllm_backend import BackendUnavailable, VLLMBackend, choose_backend, vllm_importable

    device = resolve_device(args.device)
    try:  # auto takes vLLM only where the model runs on CUDA
        backend = choose_backend(args.backend, cuda=None if device.type == "cuda" else False)
    except BackendUnavailable as exc:
        if device.type != "cuda" and vllm_importable():  # vLLM is there: the device is what is missing
            raise SystemExit(f"fedmosaic batch: --backend vllm runs on CUDA, but the device is {device} "
                             "(--device / FEDMOSAIC_DEVICE)") from exc
        raise SystemExit(f"fedmosaic batch: {exc}") from exc
    settings = settings_from_args(args)
    stack = build_stack(stack_config(settings))
    executor: Any = stack
    if backend == "vllm":
        export = Path(args.export_dir) if args.export_dir else Path(tempfile.mkdtemp(prefix="fedmosaic-levels-"))
        executor = VLLMBackend(stack, export, levels=args.levels, max_model_len=args.max_model_len)
    config = BatchConfig(max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens)
    summary = run_batch(executor, stack.loaded.tokenizer, args.input, args.output, config,
                        progress=not args.no_progress)
    print(json.dumps({**summary.__dict__, "backend": backend}))
    return 0
