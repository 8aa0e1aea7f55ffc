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
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from models.settings import DEVICE_HELP, device_option, resolve_device
from routing.feddpa_options import OPTION_NAMES, add_option_arguments
from serving.engine.config import EngineConfig
from serving.settings import ENGINE_LIMITS, ServeSettings

_SIZE_LIMITS = ("max_batch_size", "max_model_len")  # the engine limits `fedmosaic batch` takes too


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    # every default is None: an option left out never overrides FEDMOSAIC_SERVE_* (ServeSettings' defaults apply)
    p.add_argument("sources", nargs="*", help="RUN_DIR (with run.json) or adapter folders as name=folder")
    p.add_argument("--model", default=None, help="base model: smollm2 (default; a run's own from its run.json), "
                   "tiny, or an HF folder")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name of the base model in the API; more names are aliases (as vLLM)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "autocast-bf16"])
    p.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    p.add_argument("--max-loras", type=int, default=None, help="adapters loaded at once (LRU beyond; default 16)")
    _add_engine_arguments(p, _SIZE_LIMITS)
    p.add_argument("--max-tokens-limit", type=int, default=None, help="default 1024")
    p.add_argument("--adapter-root", default=None,
                   help="runtime-loaded adapters must lie inside it (default: the run directory)")
    p.add_argument("--target-modules", default=None, metavar="SPEC",
                   help="Linear layers to adapt besides the served adapters' own targets: names (q_proj,v_proj), "
                        "a regex or all-linear (every Linear but lm_head), so runtime-loaded adapters fit")
    p.add_argument("--check-base", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse adapters whose adapter_config.json names another base model (default on; a Hub "
                        "id and a local folder of the same name match)")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="sampling defaults of fields a request leaves unset: auto (the model's "
                        "generation_config.json; default), vllm (none), or DIR's generation_config.json")
    add_option_arguments(p, env="FEDMOSAIC_SERVE_FEDDPA_")  # each FedDPA option's one definition


def add_serve_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible server for the base model and its adapters")
    _add_model_arguments(p)
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--api-key", action="append", default=None,
                   help="user bearer key (repeatable); visible in `ps`: prefer FEDMOSAIC_SERVE_API_KEYS or "
                        "--api-key-file")
    p.add_argument("--api-key-file", default=None, help="user keys, one per line")
    p.add_argument("--admin-key-file", default=None,
                   help="admin keys, one per line (or FEDMOSAIC_SERVE_ADMIN_KEYS): adapter load/unload, run files")
    p.add_argument("--key-bindings", default=None, help="JSON file binding user keys to the targets they may use")
    p.add_argument("--runtime-lora", action=argparse.BooleanOptionalAction, default=None,
                   help="enable /v1/load_lora_adapter and unload (default: on when an admin key is set)")
    p.add_argument("--routing-details", choices=["admin", "all", "none"], default=None,
                   help="who sees FedDPA similarities in responses (default: admin keys only)")
    p.add_argument("--protect-metrics", action=argparse.BooleanOptionalAction, default=None,
                   help="/metrics needs an admin key")
    p.add_argument("--strict-fields", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse (400) request fields this server does not implement (default: ignore each with "
                        "one warning per name, as vLLM)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="CORS: browser origins allowed to call the API ('*': any; default: none)")
    _add_engine_arguments(p, tuple(n for n in ENGINE_LIMITS if n not in _SIZE_LIMITS))
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="seconds running requests get to finish on shutdown (default 10)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch profiler trace of 16 engine steps (after the first 8) into DIR")
    p.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=None,
                   help="exit with status 70 when the engine thread dies, for a supervisor to restart (default on)")
    limits = p.add_argument_group("connection limits (docs/serving.md, security model)")
    limits.add_argument("--header-timeout", type=float, default=None,
                        help="seconds a connection gets to send its request head (default 10)")
    limits.add_argument("--body-timeout", type=float, default=None,
                        help="seconds a request body gets to arrive after its head: 408 beyond (default 30)")
    limits.add_argument("--keep-alive", type=int, default=None, help="idle keep-alive seconds (default 5)")
    limits.add_argument("--max-connections", type=int, default=None,
                        help="open connections and requests at most: 503 beyond (default 512)")
    limits.add_argument("--max-header-bytes", type=int, default=None, help="request head size at most (default 65536)")
    return p


def _add_engine_arguments(p: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """Add a flag for each engine limit in ``names``: help from its one definition (``EngineConfig``, through
    ``ServeSettings``), the server's default told, the flag spelt without a ``_s`` unit suffix."""
    hints = typing.get_type_hints(EngineConfig)
    for name in names:
        setting = ServeSettings.model_fields[name]
        default = setting.default
        told = "" if default is None or isinstance(default, bool) else f" (default {default:g})"
        flag = name.removesuffix("_s").replace("_", "-")
        kind: dict[str, Any] = ({"action": "store_true"} if hints[name] is bool else
                                {"type": int if hints[name] is int else _timeout, "metavar": name.upper()})
        # default None: a flag left out never overrides FEDMOSAIC_SERVE_<NAME>
        p.add_argument(f"--{flag}", dest=name, default=None, help=f"{setting.description}{told}", **kind)


_NO_DEADLINE = object()  # --request-timeout none: passed as None, which the settings read as "no deadline"


def _timeout(text: str) -> float | object:
    """``--request-timeout``: seconds, or ``none``."""
    if text.strip().lower() == "none":
        return _NO_DEADLINE
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {text!r}") from None


# argparse destination -> ServeSettings field, for the options that map one to one
_OPTIONS = {"model": "model", "served_model_name": "served_model_name", "dtype": "dtype", "device": "device",
            "max_loras": "max_loras", "max_tokens_limit": "max_tokens_limit", "adapter_root": "adapter_root",
            "target_modules": "target_modules", "check_base": "check_base",
            "host": "host", "port": "port", "api_key": "api_keys",
            "api_key_file": "api_key_file", "admin_key_file": "admin_key_file", "key_bindings": "key_bindings",
            "runtime_lora": "allow_runtime_lora", "routing_details": "routing_details",
            "protect_metrics": "protect_metrics", "strict_fields": "strict_fields",
            "generation_config": "generation_config", "allowed_origins": "allowed_origins",
            "default_max_tokens": "default_max_tokens",
            "shutdown_timeout": "shutdown_timeout_s", "exit_on_engine_failure": "exit_on_engine_failure",
            "profile": "profile_dir", "header_timeout": "header_timeout_s",
            "body_timeout": "body_timeout_s", "keep_alive": "keep_alive_s", "max_connections": "max_connections",
            "max_header_bytes": "max_header_bytes", **{name: name for name in ENGINE_LIMITS},
            **{f"feddpa_{name}": f"feddpa_{name}" for name in OPTION_NAMES}}


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Translate parsed options into settings (one run directory at most).

    Only the options given on the command line are passed: the others come from the environment
    (``FEDMOSAIC_SERVE_*``) or the settings' defaults.
    """
    sources = list(args.sources)
    given: dict[str, Any] = {field: getattr(args, dest) for dest, field in _OPTIONS.items()
                             if getattr(args, dest, None) is not None}
    if sources and args.model is None and _model_folder(Path(sources[0])):  # vLLM's habit: `serve MODEL`
        given["model"] = sources.pop(0)
    names = given.pop("served_model_name", None)
    if names:
        given["served_model_name"], given["model_aliases"] = names[0], names[1:]
    runs = [s for s in sources if "=" not in s and (Path(s) / "run.json").is_file()]
    if len(runs) > 1:
        raise SystemExit("fedmosaic: give one run directory at most")
    if runs:
        given["run_dir"] = Path(runs[0])
    adapters = [s if "=" in s else f"{Path(s).resolve().name}={s}" for s in sources if s not in runs]
    for source, spec in zip([s for s in sources if s not in runs], adapters, strict=True):
        check_adapter_source(spec, bare="=" not in source)  # before any model loads or port opens
    if adapters:
        given["adapters"] = adapters
    given = {k: None if v is _NO_DEADLINE else v for k, v in given.items()}
    try:
        return ServeSettings(**given)
    except ValidationError as exc:
        # a check across settings has no field to name: its message stands alone
        problems = "; ".join(": ".join(filter(None, (".".join(str(p) for p in e["loc"]), e["msg"])))
                             for e in exc.errors())
        raise SystemExit(f"fedmosaic: invalid server settings: {problems}") from None


def _model_folder(path: Path) -> bool:
    """True for a base model's folder (``config.json``, no adapter or run files): ``fedmosaic serve MODEL``."""
    return (path / "config.json").is_file() and not (path / "adapter_config.json").is_file() \
        and not (path / "run.json").is_file()


def check_adapter_source(spec: str, bare: bool = False) -> None:
    """Exit naming ``spec`` (``name=folder``) when its folder is missing or not a readable PEFT adapter.

    ``bare``: the source was given as a folder alone, which may be a base model meant for ``--model``.

    Raises:
        SystemExit: the folder does not exist, its ``adapter_config.json`` is missing or malformed, or its
            weights file is missing or unreadable (the safetensors header is read; no tensor is loaded).
    """
    from safetensors import safe_open

    from adapters import AdapterError
    from adapters.io import WEIGHTS_FILE, read_adapter_config

    name, _, folder = spec.partition("=")
    path = Path(folder)
    problem = None
    if not path.is_dir():
        problem = f"the adapter folder {folder} does not exist" if not path.exists() else f"{folder} is not a folder"
        if not path.exists() and bare:
            problem += (" (a source is a run directory or an adapter folder; to serve a base model, pass "
                        f"--model {folder})")
    else:
        try:
            read_adapter_config(path)
            with safe_open(str(path / WEIGHTS_FILE), "pt") as weights:  # the header only
                weights.keys()
        except AdapterError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types for a missing or torn file
            problem = f"{path / WEIGHTS_FILE} is not a readable safetensors file: {exc}"
    if problem is not None:
        raise SystemExit(f"fedmosaic: adapter {name!r}: {problem}")


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from routing.base import RoutingError
    from serving.access import AccessConfigError
    from serving.api import create_app
    from serving.api.server import uvicorn_options

    settings = settings_from_args(args)
    try:
        app = create_app(settings)
    except (AccessConfigError, RoutingError, ValueError) as exc:  # ValueError: --generation-config DIR's file
        raise SystemExit(f"fedmosaic serve: {exc}") from exc
    uvicorn.run(app, log_level="info", **uvicorn_options(settings))
    return 0


def add_batch_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``batch`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser("batch", help="answer an OpenAI batch file (JSONL) offline, with continuous batching")
    p.add_argument("-i", "--input", required=True, help="batch file: OpenAI batch lines or bare request bodies")
    p.add_argument("-o", "--output", required=True, help="results (OpenAI batch output format; resumable)")
    _add_model_arguments(p)
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of chat lines that set none (default 128)")
    p.add_argument("--backend", choices=["auto", "torch", "vllm"], default="auto",
                   help="auto: vLLM when it imports and the device is CUDA, else the PyTorch engine")
    p.add_argument("--levels", type=int, default=11, help="vLLM backend: quantisation levels of the FedDPA weight")
    p.add_argument("--export-dir", default=None, help="vLLM backend: where (client, level) adapters are written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_batch(args: argparse.Namespace) -> int:
    """Answer the batch file; print a JSON summary. Exit status 1 when any line failed (each has its error
    record in the output), else 0."""
    from functools import partial

    from routing.base import RoutingError
    from serving.batch import BatchConfig, run_batch
    from serving.openai.chat_format import trained_style
    from serving.openai.compat import generation_defaults
    from serving.stack import build_stack, stack_config
    from serving.vllm_backend import BackendUnavailable, VLLMBackend, choose_backend, vllm_importable

    settings = settings_from_args(args)
    device = resolve_device(settings.device)
    try:  # auto takes vLLM only where the model runs on CUDA
        backend = choose_backend(args.backend, cuda=None if device.type == "cuda" else False)
    except BackendUnavailable as exc:
        if device.type != "cuda" and vllm_importable():  # vLLM is there: the device is what is missing
            raise SystemExit(f"fedmosaic batch: --backend vllm runs on CUDA, but the device is {device} "
                             "(--device / FEDMOSAIC_DEVICE)") from exc
        raise SystemExit(f"fedmosaic batch: {exc}") from exc
    try:
        stack = build_stack(stack_config(settings))
    except RoutingError as exc:  # e.g. indexes pooled otherwise than --feddpa-embedding: one line, no traceback
        raise SystemExit(f"fedmosaic batch: {exc}") from exc
    executor: Any = stack
    if backend == "vllm":
        export = Path(args.export_dir) if args.export_dir else Path(tempfile.mkdtemp(prefix="fedmosaic-levels-"))
        executor = VLLMBackend(stack, export, levels=args.levels, max_model_len=stack.engine.config.max_model_len)
    try:
        defaults = generation_defaults(settings.generation_config, getattr(stack.loaded.model, "generation_config",
                                                                           None))
    except ValueError as exc:
        raise SystemExit(f"fedmosaic batch: {exc}") from exc
    config = BatchConfig(max_tokens_limit=settings.max_tokens_limit, default_max_tokens=settings.default_max_tokens,
                         exact_prefill=settings.feddpa_prefill == "exact", defaults=defaults)
    summary = run_batch(executor, stack.loaded.tokenizer, args.input, args.output, config,
                        progress=not args.no_progress, styles=partial(trained_style, stack))
    print(json.dumps({**summary.__dict__, "backend": backend}))
    return 1 if summary.failed else 0
