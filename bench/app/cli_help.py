"""How long ``fedmosaic --help``, ``fedmosaic --version`` and every subcommand's ``--help`` take, in fresh processes.

Each command runs as a user runs it: the ``fedmosaic`` console script beside this Python (``python -m
fedmosaic.cli`` without one), a new process every time, so each run pays the interpreter's start-up and
every import the command makes. The commands are interleaved round by round (a shared machine's drift
hits them alike); per command: the median and the fastest of ``--rounds`` runs, in seconds, and whether
the median is under ``--target``. The command's ``--help`` should import no subcommand's module and each
subcommand's ``--help`` its own module alone (:mod:`fedmosaic.plugins`); what that module imports at
the top is what remains.

``--tree DIR`` times another checkout's command instead (``python -m fedmosaic.cli`` with ``DIR`` first on
``PYTHONPATH``, this environment's packages behind it): an earlier commit unpacked with ``git archive``
gives the figures before a change.

Prints one JSON object. Usage: ``python -m bench.app.cli_help [--rounds 3] [--target 1.0] [--only serve,train]
[--tree DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fedmosaic import plugins

BUILT_IN = ("models", "generate")


def command_line(tree: Path | None) -> list[str]:
    """How the ``fedmosaic`` command is started: ``tree``'s as a module, else the console script beside this
    Python, else ``python -m fedmosaic.cli``."""
    script = shutil.which("fedmosaic", path=str(Path(sys.executable).parent))
    return [script] if script is not None and tree is None else [sys.executable, "-m", "fedmosaic.cli"]


def cases(only: list[str] | None) -> dict[str, list[str]]:
    """Label -> arguments: the command's ``--help`` and ``--version``, then each subcommand's ``--help``."""
    names = [*BUILT_IN, *(c.name for c in plugins.SUBCOMMANDS)]
    out = {"--help": ["--help"], "--version": ["--version"]}
    out.update({f"{name} --help": [name, "--help"] for name in names})
    return {k: v for k, v in out.items() if only is None or k.split()[0] in only}


def time_once(argv: list[str], tree: Path | None) -> tuple[float, int]:
    """(seconds from starting ``argv`` (in ``tree`` when given) to its exit, its exit status)."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
                          cwd=tree, env=env)
    return time.perf_counter() - start, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each command (interleaved)")
    parser.add_argument("--target", type=float, default=1.0, help="seconds a command's median should stay under")
    parser.add_argument("--only", default=None, help="comma-separated subcommands (--help and --version: "
                                                     "'--help', '--version')")
    parser.add_argument("--tree", type=Path, default=None, help="time DIR's command (an unpacked checkout)")
    args = parser.parse_args()
    tree = args.tree.resolve() if args.tree is not None else None
    base = command_line(tree)
    todo = cases(args.only.split(",") if args.only else None)
    times: dict[str, list[float]] = {label: [] for label in todo}
    status: dict[str, int] = {}
    for _ in range(args.rounds):
        for label, argv in todo.items():
            seconds, status[label] = time_once([*base, *argv], tree)
            times[label].append(seconds)
    # a command that fails (an older tree without it) is reported with its exit status, not timed
    results = {label: {"median_s": round(statistics.median(ts), 3), "min_s": round(min(ts), 3),
                       "under_target": statistics.median(ts) < args.target} if status[label] == 0
               else {"exit_status": status[label]} for label, ts in times.items()}
    print(json.dumps({"benchmark": "cli_help", "command": " ".join(base), "tree": str(tree or ""),
                      "rounds": args.rounds,
                      "target_s": args.target, "results": results,
                      "over_target": sorted(k for k, v in results.items() if not v.get("under_target", True))},
                     indent=1))


if __name__ == "__main__":
    main()
