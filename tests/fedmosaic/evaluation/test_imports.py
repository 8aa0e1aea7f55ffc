"""The evaluation package has no import cycle: the evaluator and its backend meet only in ``backend.py``."""

from __future__ import annotations

import grimp


def test_no_module_of_the_package_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("fedmosaic")
    modules = sorted(m for m in graph.modules if m.startswith("fedmosaic.evaluation."))
    assert {"fedmosaic.evaluation.evaluate", "fedmosaic.evaluation.stack_backend"} <= set(modules)
    cycles = [(a, b) for a in modules for b in modules
              if a < b and graph.chain_exists(a, b) and graph.chain_exists(b, a)]
    assert not cycles, cycles
    assert not graph.chain_exists("fedmosaic.evaluation.stack_backend", "fedmosaic.evaluation.evaluate")
