"""Loaders: the FedDPA format, the Dolly split, a generic per-client folder, and one dispatcher.

The dispatcher (:func:`load_dataset`) also hands tables (CSV, TSV, JSON/JSONL, Parquet, ``save_to_disk``, a
cached Hub data set; :mod:`training.data.tables`) and ``--partition`` (:mod:`training.data.partitioners`) on.

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
import re
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.data.benchmarks import BENCHMARKS, benchmark_roots, identify
from training.data.records import ClientData, DataError, FederatedDataset, Record, count_duplicates

# How a user gets the benchmark data (``fedmosaic data fetch`` writes the user's data cache).
DATA_DIR_HELP = ("run `fedmosaic data fetch NAME` (into ~/.cache/fedmosaic/data), or set FEDMOSAIC_DATA_DIR to the "
                 "folder holding feddpa/ and dolly_fed8/ (export FEDMOSAIC_DATA_DIR=DIR)")
# The options that make clients from pooled rows (``--columns``, ``--partition``; :func:`load_dataset`).
TABLE_OPTIONS = ("columns", "partition", "by", "clients", "partition_seed", "split")


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
        spec: ``feddpa1``, ``feddpa2``, ``dolly`` (benchmark data in ``FEDMOSAIC_DATA_DIR`` or the data cache
            ``fedmosaic data fetch`` fills), ``generated`` (the project's own task suite; ``options`` go to
            ``generate_suite``), a folder in the FedDPA or the generic layout, or a table
            (:mod:`training.data.tables`: a CSV, TSV, JSON, JSONL or Parquet file or folder, a ``save_to_disk``
            folder, a Hub id in the local Hugging Face cache).
        folder: the benchmark data folder (default: ``FEDMOSAIC_DATA_DIR``, then the data cache).
        **options: the loader's options; ``leave_out`` (a task, a comma-separated list or a list) drops the
            clients of those tasks and keeps their test sets: FedOA's leave-one-task-out (paper 001 s5.1);
            ``hold_out`` (a share in (0, 0.5]) moves that share of each client's examples to its validation
            set (``partition.hold_out``, seeded by ``hold_out_seed``, default 0); ``columns`` maps a table's
            columns to roles; ``partition`` (with ``by``, ``clients``, ``partition_seed``) pools the rows
            and splits them (:mod:`training.data.partitioners`); ``split`` (client -> row numbers, a run's
            ``split.json``) rebuilds the clients a partition made.
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
    table_options = {k: options.pop(k) for k in TABLE_OPTIONS if options.get(k) is not None}
    if spec in BENCHMARKS:
        roots = [Path(folder) / BENCHMARKS[spec].folder] if folder is not None else benchmark_roots(spec)
        root = next((r for r in roots if r.is_dir()), None)
        if root is None:
            raise DataError(f"benchmark data {spec!r} is not in {' nor '.join(map(str, roots))}: "
                            + DATA_DIR_HELP.replace("NAME", spec))
        dataset: FederatedDataset | None = load_feddpa_format(root, name=spec)
    elif spec == "generated":
        from training.data.generated import generate_suite

        dataset = generate_suite(**options)
    else:
        dataset = _load_path(spec, "columns" in table_options)
    if dataset is not None and "columns" in table_options:
        raise DataError(f"--columns maps a table's columns; {spec!r} is a folder of JSON client files, whose fields "
                        "are instruction, input, output, task and category")
    if dataset is not None and not table_options:
        return dataset
    from training.data.partitioners import make_clients

    return make_clients(spec, dataset, **table_options)


def _load_path(spec: str, table: bool) -> FederatedDataset | None:
    """A folder in the generic or FedDPA layout, or None for a table source (read by the partitioners)."""
    from training.data.tables import DISK_MARKERS, is_table_source

    path = Path(spec).expanduser()
    if path.is_dir() and any((path / m).is_file() for m in DISK_MARKERS):
        return None  # a save_to_disk folder (its train/ is Arrow, not the generic layout)
    if path.is_dir() and (path / "train").is_dir():
        return load_folder(path)
    if path.is_dir() and any(path.glob("*/local_training_*.json")):
        return load_feddpa_format(path, name=identify(path))
    if table or is_table_source(spec):
        return None
    if path.is_dir():
        raise DataError(f"{path} holds no data: expected train/<client>.jsonl, the FedDPA layout "
                        "(8/local_training_<i>.json), a save_to_disk folder or .csv/.tsv/.json/.jsonl/.parquet files")
    raise DataError(f"unknown data set {spec!r}: not feddpa1/feddpa2/dolly/generated, not a file or folder, and not "
                    "a Hub id (owner/name)")


def load_run_dataset(config: Mapping[str, Any], spec: str | None = None, run_dir: Path | None = None,
                     ) -> FederatedDataset:
    """The clients a run trained, from its ``run.json``: the data set, its options and the task split.

    Args:
        config: the run's ``run.json``.
        spec: another data set spec to load instead of the recorded one (same options and split).
        run_dir: the run directory: a ``split.json`` there (a ``--partition``'s) gives each client's rows.
    """
    from training.data.partition import split_tasks
    from training.data.partitioners import read_split

    options = dict(config.get("data_options") or {})
    same = spec is None or spec == config["data"]  # another data set's rows are not the split's
    recorded = read_split(run_dir) if run_dir is not None and same else None
    if recorded is not None:
        options["split"] = recorded
    dataset = load_dataset(spec or config["data"], **options)
    k = int(config.get("clients_per_task") or 1)
    return split_tasks(dataset, k, seed=int(config.get("seed") or 0)) if k > 1 else dataset
