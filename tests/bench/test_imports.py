"""Every benchmark module imports, and every script's ``--help`` parses: no stale import after a move.

The benchmarks are run by hand (``python -m bench.<subsystem>.<name>``), so nothing else imports most of
them; a module renamed in ``training/`` or ``serving/`` would otherwise break them unseen. Importing one
runs nothing: each script measures only under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import importlib
import pkgutil
import runpy
import sys
from pathlib import Path

import pytest

import bench

MODULES = sorted(m.name for m in pkgutil.walk_packages(bench.__path__, "bench.") if not m.ispkg)
HELPERS = {"bench.serving.common", "bench.serving.load_probe", "bench.training.plain_peft", "bench.training.step_flops"}


def test_every_benchmark_file_is_a_module_here() -> None:
    root = Path(bench.__file__).parent
    files = {".".join(("bench", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")}
    assert {f for f in files if not f.endswith("__init__")} == set(MODULES)
    assert {m.split(".")[1] for m in MODULES} == {"app", "serving", "training"}


@pytest.mark.parametrize("name", MODULES)
def test_the_module_imports(name: str) -> None:
    importlib.import_module(name)


# The module was imported by the test above; runpy warns that it runs a fresh copy as __main__, which is
# what `python -m` does too.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(set(MODULES) - HELPERS))
def test_the_scripts_help_parses(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                 ) -> None:
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
