"""Loaders: the FedDPA format, the Dolly split, a generic per-client folder, and one dispatcher.

FedDPA format (paper 000, appendix A.1; also the Dolly split): ``<dataset>/8/local_training_<i>.json``
(a JSON list per client) and one ``*test*.jsonl`` with every task's test examples (a ``task`` field,
or ``category`` for Dolly). Generic folder, for your own data::

    my_data/
      train/<client>.jsonl  (or .json: a list)   one file per client; records need instruction, output
      test/<task>.jsonl     (optional)            one test set per task; a client's task is the ``task``
                                                  field of its records (else the client's name)

Every record needs ``instruction`` and ``output``; ``input``, ``task`` and ``category`` are optional.
Errors name the file and the record; test examples that also appear in training are warned about and
counted (Dolly has near-duplicates).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.data.records import ClientData, DataError, FederatedDataset, Record, count_duplicates

BENCHMARKS = {"feddpa1": ("feddpa", "dataset1"), "feddpa2": ("feddpa", "dataset2"), "dolly": ("dolly_fed8", "dataset1")}
# How a user points the loaders at the benchmark data (``make`` sets it when the data sits beside the checkout).
DATA_DIR_HELP = "set FEDMOSAIC_DATA_DIR to the folder holding feddpa/ and dolly_fed8/ (export FEDMOSAIC_DATA_DIR=DIR)"


def data_dir() -> Path | None:
    """The benchmark data folder: ``FEDMOSAIC_DATA_DIR``, or None when it is not set.

    Read when asked (not at import), so a test can set the variable and see it.
    """
    env = os.environ.get("FEDMOSAIC_DATA_DIR")
    return Path(env).expanduser() if env else None


def _record(raw: Any, where: str, default_task: str = "", require_output: bool = True) -> Record:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    for name in ("instruction", "output"):
        if name not in raw:
            if name == "output" and not require_output:
                continue
            raise DataError(f"{where}: missing field {name!r} (fields: {sorted(raw)})")
        if not isinstance(raw[name], str):
            raise DataError(f"{where}: field {name!r} must be a string")
    category = str(raw.get("category") or "")
    return Record(
        instruction=raw["instruction"],
        output=raw.get("output", ""),
        input=str(raw.get("input") or ""),
        task=str(raw.get("task") or category or default_task),
        category=category,
    )


def read_records(path: Path, default_task: str = "", require_output: bool = True) -> list[Record]:
    """Read a JSON list or a JSONL file of records, naming the file and line on any error.

    Args:
        path: the ``.json`` (a list) or ``.jsonl`` file.
        default_task: the task of records without a ``task`` or ``category`` field.
        require_output: refuse records without ``output``; False reads them with an empty output, so
            the caller can say why it needs one (evaluation: the metric scores against references).
    """
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is unreadable: {exc}") from exc
    if path.suffix == ".jsonl":
        rows: list[tuple[str, Any]] = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{n} is not valid JSON: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DataError(f"{path} must hold a JSON list of records, got {type(data).__name__}")
        rows = [(f"{path} record {i}", r) for i, r in enumerate(data)]
    return [_record(r, where, default_task, require_output) for where, r in rows]


def _finish(name: str, clients: list[ClientData], tests: dict[str, list[Record]]) -> FederatedDataset:
    frozen = {t: tuple(rs) for t, rs in tests.items()}
    dups = count_duplicates(tuple(clients), frozen)
    if dups:
        warnings.warn(f"{name}: {dups} test examples also appear in the training data", stacklevel=3)
    return FederatedDataset(name=name, clients=tuple(clients), tests=frozen, duplicates=dups)


def load_feddpa_format(root: Path, name: str | None = None, num_clients: int = 8) -> FederatedDataset:
    """Load ``root/<num_clients>/local_training_<i>.json`` and ``root/*test*.jsonl``.

    Each client's task is the most common ``task`` (or ``category``) among its records.
    """
    root = Path(root)
    folder = root / str(num_clients)
    if not folder.is_dir():
        raise DataError(
            f"{folder} does not exist (expected the FedDPA layout <dataset>/{num_clients}/local_training_<i>.json)"
        )
    files = sorted(folder.glob("local_training_*.json"), key=lambda p: int(re.findall(r"\d+", p.stem)[-1]))
    if not files:
        raise DataError(f"{folder} holds no local_training_<i>.json files")
    clients = []
    for path in files:
        records = read_records(path)
        if not records:
            raise DataError(f"{path}: client has no training examples")
        task = Counter(r.task for r in records).most_common(1)[0][0]
        clients.append(ClientData(client_id=path.stem.rsplit("_", 1)[-1], task=task, train=tuple(records)))
    tests: dict[str, list[Record]] = {}
    for path in sorted(root.glob("*test*.jsonl")):
        for r in read_records(path):
            tests.setdefault(r.task, []).append(r)
    if not tests:
        raise DataError(f"{root} holds no *test*.jsonl file")
    return _finish(name or root.name, clients, tests)


def load_folder(root: Path, name: str | None = None) -> FederatedDataset:
    """Load the generic layout (``train/<client>.jsonl|json``, optional ``test/<task>.jsonl|json``)."""
    root = Path(root)
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DataError(f"{train_dir} does not exist (expected <folder>/train/<client>.jsonl)")
    files = sorted(p for p in train_dir.iterdir() if p.suffix in (".json", ".jsonl"))
    if not files:
        raise DataError(f"{train_dir} holds no .json or .jsonl client files")
    clients = []
    for path in files:
        records = read_records(path, default_task=path.stem)
        if not records:
            raise DataError(f"{path}: client {path.stem!r} has no training examples")
        task = Counter(r.task for r in records).most_common(1)[0][0]
        clients.append(ClientData(client_id=path.stem, task=task, train=tuple(records)))
    tests: dict[str, list[Record]] = {}
    test_dir = root / "test"
    if test_dir.is_dir():
        for path in sorted(p for p in test_dir.iterdir() if p.suffix in (".json", ".jsonl")):
            for r in read_records(path, default_task=path.stem):
                tests.setdefault(r.task, []).append(r)
    return _finish(name or root.name, clients, tests)


def load_dataset(spec: str, folder: Path | None = None, **options: Any) -> FederatedDataset:
    """Load a data set by name or path.

    Args:
        spec: ``feddpa1``, ``feddpa2``, ``dolly`` (benchmark data under ``FEDMOSAIC_DATA_DIR``),
            ``generated`` (the project's own task suite; ``options`` go to ``generate_suite``), or
            a folder in the FedDPA or the generic layout.
        folder: the benchmark data folder (default: :func:`data_dir`, ``FEDMOSAIC_DATA_DIR``).
        **options: the loader's options; ``leave_out`` (a task, a comma-separated list or a list) drops the
            clients of those tasks and keeps their test sets: FedOA's leave-one-task-out (paper 001 s5.1);
            ``hold_out`` (a share in (0, 0.5]) moves that share of each client's examples to its validation
            set (``partition.hold_out``, seeded by ``hold_out_seed``, default 0).
    """
    share = options.pop("hold_out", None)
    split_seed = options.pop("hold_out_seed", 0)
    if share is not None:
        from training.data.partition import hold_out

        return hold_out(load_dataset(spec, folder, **options), share, seed=int(split_seed))
    held = options.pop("leave_out", None)
    if held:
        from training.data.partition import leave_out

        tasks = held.split(",") if isinstance(held, str) else list(held)
        return leave_out(load_dataset(spec, folder, **options), [t for t in tasks if t])
    if spec in BENCHMARKS:
        base = folder or data_dir()
        if base is None:
            raise DataError(f"benchmark data {spec!r} needs FEDMOSAIC_DATA_DIR, which is not set: {DATA_DIR_HELP}")
        group, dataset = BENCHMARKS[spec]
        root = Path(base) / group / dataset
        if not root.is_dir():
            raise DataError(f"{root} does not exist; {DATA_DIR_HELP}")
        return load_feddpa_format(root, name=spec)
    if spec == "generated":
        from training.data.generated import generate_suite

        return generate_suite(**options)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise DataError(f"unknown data set {spec!r}: not feddpa1/feddpa2/dolly/generated and not a folder")
    if (path / "train").is_dir():
        return load_folder(path)
    return load_feddpa_format(path)


def load_run_dataset(config: Mapping[str, Any], spec: str | None = None) -> FederatedDataset:
    """The clients a run trained, from its ``run.json``: the data set, its options and the task split.

    Args:
        config: the run's ``run.json``.
        spec: another data set spec to load instead of the recorded one (same options and split).
    """
    from training.data.partition import split_tasks

    dataset = load_dataset(spec or config["data"], **(config.get("data_options") or {}))
    k = int(config.get("clients_per_task") or 1)
    return split_tasks(dataset, k, seed=int(config.get("seed") or 0)) if k > 1 else dataset
