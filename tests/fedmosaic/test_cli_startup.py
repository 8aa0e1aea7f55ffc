"""``fedmosaic --version``, and a ``--help`` that imports only what it shows: no torch for the command's own
help, no other subcommand's module for a subcommand's (the times are ``bench/app/cli_help.py``'s)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from fedmosaic import plugins
from fedmosaic.cli import named_subcommand

PROBE = """
import json, sys
from fedmosaic.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.split(".")[0] in
      ("torch", "transformers", "training", "serving", "fedmosaic", "demos"))}), file=sys.stderr)
"""


def probe(*argv: str) -> tuple[str, int, list[str]]:
    """(stdout, exit status, our and torch's modules imported) of ``fedmosaic ARGV`` in a fresh process."""
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    seen = json.loads(run.stderr.strip().splitlines()[-1])
    return run.stdout, int(seen["code"] or 0), list(seen["modules"])


def test_version() -> None:
    run = subprocess.run([sys.executable, "-m", "fedmosaic.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"fedmosaic {metadata.version('fedmosaic')}"


def test_the_commands_help_imports_no_torch_and_no_subcommand() -> None:
    out, code, modules = probe("--help")
    assert code == 0 and "serve" in out and "train" in out
    assert modules == ["fedmosaic", "fedmosaic.cli", "fedmosaic.plugins"]


@pytest.mark.parametrize("name", ["demo", "quickstart"])
def test_a_subcommands_help_imports_its_module_alone(name: str) -> None:
    out, code, modules = probe(name, "--help")
    own = next(c.module for c in plugins.SUBCOMMANDS if c.name == name)
    others = {c.module for c in plugins.SUBCOMMANDS} - {own}
    assert code == 0 and out.startswith(f"usage: fedmosaic {name}")
    assert own in modules and not others & set(modules)


def test_the_named_subcommand_skips_global_options() -> None:
    assert named_subcommand(["-v", "serve", "run"]) == "serve"
    assert named_subcommand(["--help"]) is None
