"""The test sets an evaluation scores on: the run's own (default) or any other (``fedmosaic eval --test``).

Paper 000 (Table 14) and paper 001 also score personalised models on tasks no client trained on; a user
does the same with held-out data. ``--test`` takes:

* a data set name (``feddpa1``, ``feddpa2``, ``dolly``, ``generated``): its test sets;
* a folder with a ``test/`` subfolder (the generic layout; its ``train/`` is not read);
* a folder of ``<task>.jsonl|json`` files (a FedDPA folder's ``*test*.jsonl`` included);
* one ``.jsonl|.json`` file.

A record's task is its ``task`` (or ``category``) field, else its file's name. The run's clients, their
adapters and their own tasks are unchanged; a client whose own task is absent simply has no
personalization score. :func:`check_test_set` refuses a set that cannot be scored before anything is
generated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from training.data import DataError, FederatedDataset, Record, load_dataset, read_records
from training.data.loaders import BENCHMARKS

_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class TestSet:
    """Test examples per task, and where they came from.

    Attributes:
        name: the short name shown in the table's title and ``results.json``.
        source: the spec as given (``None``: the run's own data set, as ``run.json`` names it).
        tests: task -> its test examples.
    """

    __test__ = False  # not a pytest class, despite the name

    name: str
    source: str | None
    tests: Mapping[str, tuple[Record, ...]] = field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        """Tasks with at least one example, sorted."""
        return sorted(t for t, records in self.tests.items() if records)

    def heading(self, label: str) -> str:
        """The table's title: ``label`` on this test set, where it came from and its tasks."""
        origin = "the run's own" if self.source is None else f"from {self.source}"
        return f"{label} on test set {self.name} ({origin}; {len(self.tasks)} tasks: {', '.join(self.tasks)})"

    def summary(self, client_tasks: Mapping[str, str], limit: int | None) -> dict[str, object]:
        """What ``results.json`` records: name, source, examples per task, whose own task is present."""
        present = [c for c, t in client_tasks.items() if t in self.tests]
        return {"name": self.name, "source": self.source,
                "tasks": {t: len(self.tests[t][:limit]) for t in self.tasks},
                "clients_with_own_task": present,
                "clients_without_own_task": [c for c in client_tasks if c not in present],
                "tasks_no_client_trained_on": [t for t in self.tasks if t not in client_tasks.values()]}


def spec_name(spec: str) -> str:
    """The name of ``spec``'s test set: the data set name, the folder's (the parent's for ``test/``) or file's stem."""
    if spec in BENCHMARKS or spec == "generated":
        return spec
    path = Path(spec).expanduser().resolve()
    if path.suffix in _SUFFIXES:
        return path.stem
    return path.parent.name if path.name == "test" and path.parent.name else path.name


def slug(name: str) -> str:
    """``name`` as one safe folder name (evaluations on other test sets live in ``eval/test-sets/<slug>``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "test"


def of_dataset(dataset: FederatedDataset, data: str | None = None) -> TestSet:
    """The clients' data set's own test sets (``fedmosaic eval RUN`` without ``--test``).

    Args:
        dataset: the clients' data set.
        data: the ``--data`` spec it was loaded from (None: ``run.json``'s, the run's own test sets).
    """
    return TestSet(dataset.name, data, dict(dataset.tests))


def load_test_set(spec: str) -> TestSet:
    """Read the test set ``spec`` names (see the module docstring for the forms it takes).

    Raises:
        DataError: ``spec`` is neither a data set name nor an existing file or folder, or a file is unreadable.
    """
    name = spec_name(spec)
    if spec in BENCHMARKS or spec == "generated":
        return TestSet(name, spec, dict(load_dataset(spec).tests))
    path = Path(spec).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        folder = path / "test" if (path / "test").is_dir() else path
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _SUFFIXES)
    else:
        raise DataError(f"test set {spec!r} is neither {sorted([*BENCHMARKS, 'generated'])} nor a file or folder")
    tests: dict[str, list[Record]] = {}
    for file in files:
        # Outputs may be missing here: check_test_set then names the metric that needs them.
        for record in read_records(file, default_task=file.stem, require_output=False):
            tests.setdefault(record.task, []).append(record)
    return TestSet(name, spec, {t: tuple(rs) for t, rs in tests.items()})


def check_test_set(test_set: TestSet, metric: str, limit: int | None) -> None:
    """Refuse a test set that cannot be scored, before any generation.

    Every metric (ROUGE-1, ROUGE-L, exact match) compares an answer with its reference, so each
    example the evaluation uses (the first ``limit`` of each task) needs a non-empty ``output``.

    Raises:
        DataError: no task has an example, or some used examples have no reference output.
    """
    where = f"test set {test_set.name!r}" + (f" ({test_set.source})" if test_set.source else "")
    if not test_set.tasks:
        raise DataError(f"{where} holds no task: no test example was found "
                        "(expected <task>.jsonl files, a test/ folder of them, or a data set name)")
    missing = {t: sum(1 for r in test_set.tests[t][:limit] if not r.output.strip()) for t in test_set.tasks}
    missing = {t: n for t, n in missing.items() if n}
    if missing:
        listed = ", ".join(f"{t}: {n}" for t, n in missing.items())
        raise DataError(f"{where}: metric {metric!r} scores answers against reference outputs, but "
                        f"{sum(missing.values())} examples have none ({listed}); give each an 'output'")

