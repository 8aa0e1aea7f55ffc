"""Load a ``bench/`` script as a module for tests: the scripts are not a package, so import them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """Execute ``bench/<name>.py`` as a fresh module named ``name`` and return it."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no bench script {name}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
