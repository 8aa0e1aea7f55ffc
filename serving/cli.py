"""``fedmosaic serve``: argv -> :class:`~serving.settings.ServeSettings` -> uvicorn running the API.

Sources are training run directories (``run.json`` + ``adapters/``) or adapter folders given as
``name=folder`` (a bare folder is served under its folder name). The lead registers the two functions
in ``fedmosaic/cli.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from serving.settings import ServeSettings


def add_serve_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible server for the base model and its adapters")
    p.add_argument("sources", nargs="*", help="RUN_DIR (with run.json) or adapter folders as name=folder")
    p.add_argument("--model", default="smollm2", help="base model: smollm2, tiny, or an HF folder")
    p.add_argument("--served-model-name", default=None, help="name of the base model in the API")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "autocast-bf16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], help="bearer key for /v1/* (repeatable)")
    p.add_argument("--max-loras", type=int, default=16, help="adapters loaded at once (LRU beyond)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens-limit", type=int, default=1024)
    p.add_argument("--adapter-root", default=None, help="runtime-loaded adapters must lie inside it")
    p.add_argument("--no-runtime-lora", action="store_true", help="disable /v1/load_lora_adapter and unload")
    return p


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Translate parsed options into settings (one run directory at most)."""
    runs = [s for s in args.sources if "=" not in s and (Path(s) / "run.json").is_file()]
    if len(runs) > 1:
        raise SystemExit("fedmosaic serve: give one run directory at most")
    adapters = [s if "=" in s else f"{Path(s).resolve().name}={s}" for s in args.sources if s not in runs]
    return ServeSettings(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, host=args.host,
        port=args.port, api_keys=args.api_key, max_loras=args.max_loras, max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len, max_tokens_limit=args.max_tokens_limit,
        run_dir=Path(runs[0]) if runs else None, adapters=adapters,
        adapter_root=Path(args.adapter_root) if args.adapter_root else None,
        allow_runtime_lora=not args.no_runtime_lora)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from serving.api import create_app

    settings = settings_from_args(args)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0
