"""The ``fedmosaic`` subcommands defined in other modules, each with the optional extras it needs.

A :class:`Subcommand` names the module that defines it (an ``add_*_arguments(subparsers)`` function
that registers its parser and a ``run_*(args)`` function that runs it) and the optional extras of
``pyproject.toml`` it needs. When every extra is installed, the module is imported and registers its
subcommand; a module of ours that then fails to import is a bug, and the error propagates. When an extra
is missing (a partial install such as the serve-only Docker image, which holds neither the train extra
nor ``training/``), the subcommand is still listed, its module is not imported, and running it exits
with one line naming the extra to install. The command line names one subcommand: only its module is
imported (:func:`register`'s ``selected``), the others are listed with their registry line, so
``fedmosaic --help`` and ``fedmosaic <name> --help`` import no other subcommand's module.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata

DISTRIBUTION = "fedmosaic"


@dataclass(frozen=True)
class Subcommand:
    """One subcommand of the registry.

    Attributes:
        name: the subcommand (``fedmosaic <name>``).
        module: the module that defines it.
        add: that module's function ``add(subparsers) -> ArgumentParser`` registering the subcommand.
        run: that module's function ``run(args) -> int``.
        extras: the optional extras (``[project.optional-dependencies]``) it needs.
        help: the one-line help listed while an extra is missing (the module's own otherwise).
    """

    name: str
    module: str
    add: str
    run: str
    extras: tuple[str, ...]
    help: str


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("train", "training.cli", "add_train_arguments", "run_train", ("train",),
               "federated training in the in-process simulator"),
    Subcommand("eval", "fedmosaic.evaluation.cli", "add_eval_arguments", "run_eval", ("train",),
               "evaluate run directories in the layout of paper 000 Table 1"),
    Subcommand("reproduce", "fedmosaic.reproduce.cli", "add_reproduce_arguments", "run_reproduce", ("train",),
               "paper 000 Table 1: train, evaluate and tabulate its cells"),
    Subcommand("serve", "serving.cli", "add_serve_arguments", "run_serve", ("serve",),
               "OpenAI-compatible server for the base model and its adapters"),
    Subcommand("batch", "serving.cli", "add_batch_arguments", "run_batch", ("serve",),
               "answer an OpenAI batch file offline"),
    Subcommand("calibrate", "fedmosaic.calibrate_cli", "add_calibrate_arguments", "run_calibrate", ("train",),
               "(re)build the calibrated FedDPA weighting of a trained run"),
    Subcommand("export", "fedmosaic.export_cli", "add_export_arguments", "run_export", (),
               "write one client's adapter of a run as a PEFT folder"),
    Subcommand("data", "fedmosaic.data_cli", "add_data_arguments", "run_data", ("train",),
               "list the data sets training can load, show a few examples"),
    Subcommand("quickstart", "fedmosaic.quickstart", "add_quickstart_arguments", "run_quickstart", ("train", "serve"),
               "train FedDPA-T on the generated suite, serve it and start the demo"),
    Subcommand("demo", "demos.cli", "add_demo_arguments", "run_demo", ("demo",),
               "the Gradio demo app (a client of a running server's API)"),
)


def missing_requirements(extra: str) -> list[str]:
    """The distributions the optional extra ``extra`` requires that are not installed (empty: installed).

    Read from the installed ``fedmosaic`` metadata. A source tree used without installing it has none;
    nothing is reported missing then, and a missing package fails its import as usual.

    Raises:
        ValueError: ``fedmosaic`` declares no extra of that name (a registry bug).
    """
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return []
    from packaging.requirements import Requirement

    provided = dist.metadata.get_all("Provides-Extra") or []
    if extra not in provided:
        raise ValueError(f"{DISTRIBUTION} has no optional extra {extra!r}; its extras: {provided}")
    missing = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or not req.marker.evaluate({"extra": extra}) or req.marker.evaluate({"extra": ""}):
            continue  # a core dependency, another extra's, or one this platform does not use
        try:
            metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
    return missing


def refusal(command: Subcommand, missing: dict[str, list[str]]) -> str:
    """The one line a subcommand with missing extras exits with: what is missing and what to install."""
    names = " and ".join(repr(e) for e in missing)
    plural = "s" if len(missing) > 1 else ""
    lacking = ", ".join(name for per_extra in missing.values() for name in per_extra)
    return (f"fedmosaic {command.name} needs the optional extra{plural} {names} (not installed: {lacking}); "
            f"install it with `pip install -e '.[{','.join(missing)}]'` in the repository (or `make venv`)")


EVERY = object()  # register's default: every subcommand's module is imported


def register(subparsers: argparse._SubParsersAction, commands: Sequence[Subcommand] | None = None,
             selected: str | None | object = EVERY) -> None:
    """Add every subcommand to ``subparsers``: its own parser, or a refusing one while an extra is missing.

    Args:
        subparsers: the ``fedmosaic`` parser's subcommands.
        commands: the subcommands to add (default: :data:`SUBCOMMANDS`).
        selected: the subcommand the command line names (None: none): only its module is imported, the
            others get a parser holding their registry line alone (they are not run). By default every
            module is imported.

    Raises:
        ModuleNotFoundError: a subcommand's module (or one it imports) is missing although its extras
            are installed: a bug, never hidden.
    """
    for command in SUBCOMMANDS if commands is None else commands:
        missing = {extra: names for extra in command.extras if (names := missing_requirements(extra))}
        if missing:
            line = refusal(command, missing)
            parser = subparsers.add_parser(command.name, help=f"{command.help} (not installed here)", description=line)
            parser.set_defaults(func=_refuse, refusal=line)
            continue
        if selected is not EVERY and command.name != selected:
            subparsers.add_parser(command.name, help=command.help)
            continue
        module = importlib.import_module(command.module)
        getattr(module, command.add)(subparsers).set_defaults(func=getattr(module, command.run))


def _refuse(args: argparse.Namespace) -> int:
    """Exit with the refusal line (on stderr, status 1)."""
    raise SystemExit(args.refusal)
