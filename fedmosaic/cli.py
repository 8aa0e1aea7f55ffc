"""The ``fedmosaic`` command: a thin argparse layer over the packages (no logic lives here).

Subcommands: ``models`` (prepare/verify/list base models, write a tiny test model), ``generate``
(a few greedy tokens with adapters), ``train``, ``eval``, ``serve``, ``data``, ``quickstart`` and
``demo`` (the Gradio app).
Each subcommand module registers its own arguments; heavy imports happen only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from models import settings

# (module, add-arguments function, run function): registered when the module is importable, so a
# partial install (for example without the serve extra) still offers the other subcommands.
PLUGINS: tuple[tuple[str, str, str], ...] = (
    ("training.cli", "add_train_arguments", "run_train"),
    ("fedmosaic.evaluation.cli", "add_eval_arguments", "run_eval"),
    ("serving.cli", "add_serve_arguments", "run_serve"),
    ("serving.cli", "add_batch_arguments", "run_batch"),
    ("fedmosaic.data_cli", "add_data_arguments", "run_data"),
    ("fedmosaic.quickstart", "add_quickstart_arguments", "run_quickstart"),
    ("demos.cli", "add_demo_arguments", "run_demo"),
)
# Our top-level packages. A plugin is left out, not fatal, when what is missing is one of them as a whole
# or a module outside them: a partial install such as the serve-only Docker image (no training/, no
# scipy). A missing submodule of a package that is present is a bug and raises.
OURS = ("adapters", "routing", "training", "serving", "demos", "fedmosaic")


def _models(args: argparse.Namespace) -> int:
    from models import prepare

    cache = Path(args.cache_dir) if args.cache_dir else None
    if args.action == "prepare":
        if args.name != prepare.SMOLLM2:
            raise SystemExit(f"fedmosaic models prepare: only '{prepare.SMOLLM2}' is embedded; got {args.name!r}")
        folder = prepare.prepare_smollm2(cache, force=args.force)
        print(folder)
    elif args.action == "verify":
        folder = prepare.smollm2_dir(cache)
        problem = prepare.check_cache(folder, full=True) if folder.is_dir() else "not prepared"
        print(f"{folder}: {'ok' if problem is None else problem}")
        return 0 if problem is None else 1
    elif args.action == "list":
        root = cache or settings.cache_dir()
        found = sorted(p for p in root.glob("*") if (p / prepare.MANIFEST).is_file()) if root.is_dir() else []
        for folder in found:
            problem = prepare.check_cache(folder)
            print(f"{folder.name}\t{folder}\t{'ok' if problem is None else problem}")
        if not found:
            print(f"no prepared models under {root}; run `fedmosaic models prepare smollm2`")
    elif args.action == "tiny":
        from models import save_tiny_llama

        print(save_tiny_llama(Path(args.name)))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from adapters import LoraConfig, inject, load_adapter
    from models import load_base_model
    from serving.generation import GenerationConfig, generate

    loaded = load_base_model(args.model, dtype=args.dtype, device=args.device)
    adapted = inject(loaded.model)
    names, weights = [], []
    for i, spec in enumerate(args.adapter or []):
        path, _, weight = spec.partition(":")
        name = f"adapter{i}"
        if path == "random":
            adapted.add_adapter(name, LoraConfig(), seed=i)
        else:
            load_adapter(adapted, path, name, check_base=False)
        names.append(name)
        weights.append(float(weight) if weight else 1.0)
    tok = loaded.tokenizer
    prompt = args.prompt
    if args.chat:
        prompt = tok.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = f"### Instruction:\n{prompt}\n\n### Response:\n"
    out = generate(adapted, loaded.model, tok, [prompt], names, [weights] if names else None,
                   GenerationConfig(max_new_tokens=args.max_new_tokens), autocast=loaded.autocast)
    print(out[0])
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the full argument parser (plugins included when importable)."""
    parser = argparse.ArgumentParser(prog="fedmosaic", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare, verify and list base models")
    models.add_argument("action", choices=["prepare", "verify", "list", "tiny"])
    models.add_argument("name", nargs="?", default="smollm2", help="'smollm2', or the output folder for 'tiny'")
    models.add_argument(
        "--cache-dir", default=None, help="model cache (default: FEDMOSAIC_CACHE_DIR or ~/.cache/fedmosaic)"
    )
    models.add_argument("--force", action="store_true", help="rebuild even when the cache is complete")
    models.set_defaults(func=_models)

    gen = sub.add_parser("generate", help="greedy generation with optional adapters")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2", help="'smollm2' or a local HF model folder")
    gen.add_argument("--adapter", action="append", help="PEFT folder (or 'random') with an optional :weight")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--chat", action="store_true", help="use the model's chat template, not the Alpaca prompt")
    gen.add_argument("--dtype", choices=settings.DTYPES, default=None)
    gen.add_argument("--device", type=settings.device_option, default=None, help=settings.DEVICE_HELP)
    gen.set_defaults(func=_generate)

    for module_name, add_name, run_name in PLUGINS:
        try:
            module = importlib.import_module(module_name)
            add: Callable[[argparse._SubParsersAction], argparse.ArgumentParser] = getattr(module, add_name)
            add(sub).set_defaults(func=getattr(module, run_name))
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module_name or module_name.startswith(exc.name) or exc.name in OURS
                             or exc.name.split(".")[0] not in OURS):
                continue
            raise
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedmosaic`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
