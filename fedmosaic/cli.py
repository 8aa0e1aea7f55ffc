"""The ``fedmosaic`` command: a thin argparse layer over the packages (no logic lives here).

Built in: ``models`` (prepare/verify/list base models, write a tiny test model) and ``generate`` (a few
greedy tokens with adapters). The others (``train``, ``eval``, ``reproduce``, ``serve``, ``batch``, ``data``,
``quickstart``, ``demo``) are registered by their own modules through :mod:`fedmosaic.plugins`, which
names the optional extra each needs; heavy imports happen only when a subcommand runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from fedmosaic import plugins
from models import settings


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
        from models.families import table

        print("Model families (the serving runner each runs on; tested: against transformers' logits):")
        print(table())
        print("\nPrepared models:")
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
    from adapters.io import read_adapter_config
    from models import load_base_model
    from serving.beam import GenerationConfig, generate

    loaded = load_base_model(args.model, dtype=args.dtype, device=args.device)
    paths = [spec.partition(":")[0] for spec in args.adapter or []]
    # the union of the adapters' target modules (a random adapter: the default q_proj, v_proj)
    adapted = inject(loaded.model, *(LoraConfig().target_modules if p == "random" else read_adapter_config(p)[0]
                                     .target_modules for p in paths))
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
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = f"### Instruction:\n{prompt}\n\n### Response:\n"
    out = generate(adapted, loaded.model, tok, [prompt], names, [weights] if names else None,
                   GenerationConfig(max_new_tokens=args.max_new_tokens), autocast=loaded.autocast)
    print(out[0])
    return 0


def build_parser(selected: str | None | object = plugins.EVERY) -> argparse.ArgumentParser:
    """Return the argument parser: the built-in subcommands and every registered plugin.

    Args:
        selected: the subcommand the command line names (None: none): only that plugin's module is
            imported (:func:`fedmosaic.plugins.register`); by default every plugin's is.

    Raises:
        ModuleNotFoundError: a plugin's module is missing although its extras are installed (a bug).
    """
    parser = argparse.ArgumentParser(prog="fedmosaic", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {version()}")
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

    plugins.register(sub, selected=selected)
    return parser


def version() -> str:
    """The installed ``fedmosaic`` version (``0+unknown`` in a source tree used without installing it)."""
    try:
        return metadata.version(plugins.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def named_subcommand(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the global options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedmosaic`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(named_subcommand(argv))  # only that subcommand's module: a fast --help
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "refusal", None) is None:  # a refused subcommand ignores its arguments
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
