"""Clients from pooled rows: ``--partition iid|dirichlet:ALPHA|shard:K|column`` by flwr-datasets' partitioners.

The rows (a table's, or every client's examples of a folder or benchmark pooled) are shuffled with the seed,
as flwr-datasets' ``FederatedDataset`` does, and split by its ``IidPartitioner``, ``DirichletPartitioner``
(label skew over the ``--by`` column), ``ShardPartitioner`` (K label-sorted shards a client) or
``NaturalIdPartitioner`` (one client per value of ``--by``). The result records which rows each client got
(:class:`Split`); training writes it to the run directory as ``split.json``
and :func:`training.data.load_run_dataset` rebuilds the clients from it, so evaluation, calibration and the
served clients' instances are those training used. Same seed, same split.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.data.records import ClientData, DataError, FederatedDataset, Record, Split, count_duplicates

SCHEMES = ("iid", "dirichlet", "shard", "column")
PARTITION_HELP = "iid | dirichlet:ALPHA | shard:K | column"
SPLIT_FILE = "split.json"


@dataclass(frozen=True)
class PartitionSpec:
    """A ``--partition`` with its ``--by``, ``--clients`` and seed.

    Attributes:
        scheme: ``iid``, ``dirichlet``, ``shard`` or ``column``.
        by: the label column (Dirichlet and shard skew over it; ``column`` makes one client per value).
        clients: the number of clients (``column``: None, one per value).
        seed: shuffles the rows and seeds the partitioner.
        alpha: Dirichlet's concentration (smaller: more skew).
        shards: shards per client (``shard:K``).
    """

    scheme: str
    by: str | None = None
    clients: int | None = None
    seed: int = 0
    alpha: float | None = None
    shards: int | None = None

    def asdict(self) -> dict[str, Any]:
        """JSON (``split.json`` and ``run.json``'s data options)."""
        return asdict(self)


def parse_partition(text: str, by: str | None = None, clients: int | None = None, seed: int = 0) -> PartitionSpec:
    """Check ``--partition`` against ``--by`` and ``--clients``.

    Raises:
        DataError: an unknown scheme, a bad ALPHA or K, or ``--by``/``--clients`` missing where needed.
    """
    scheme, _, arg = text.strip().partition(":")
    if scheme not in SCHEMES:
        raise DataError(f"--partition {text!r}: expected {PARTITION_HELP}")
    alpha = shards = None
    try:
        if scheme == "dirichlet":
            alpha = float(arg)
            if not 0 < alpha < float("inf"):
                raise ValueError
        elif scheme == "shard":
            shards = int(arg)
            if shards < 1:
                raise ValueError
        elif arg:
            raise ValueError
    except ValueError:
        want = {"dirichlet": "dirichlet:ALPHA with a finite ALPHA > 0", "shard": "shard:K with an integer K >= 1"}
        raise DataError(f"--partition {text!r}: expected {want.get(scheme, scheme + ' (no argument)')}") from None
    if scheme != "iid" and not by:
        raise DataError(f"--partition {scheme} needs --by COLUMN (the label column it splits by)")
    if scheme == "column":
        if clients is not None:
            raise DataError("--partition column makes one client per value of --by; drop --clients")
    elif clients is None or clients < 1:
        raise DataError(f"--partition {scheme} needs --clients N with N >= 1, got {clients}")
    return PartitionSpec(scheme, by, clients, int(seed), alpha, shards)


def client_name(value: str) -> str:
    """A column value as a client id (run directories take plain names: other characters become ``_``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", value.strip()) or "_"
    name = name if re.match(r"^[A-Za-z0-9_]", name) else "_" + name
    return name.replace("..", "__")


def assign(spec: PartitionSpec, labels: Sequence[str] | None, n: int) -> dict[str, tuple[int, ...]]:
    """Row numbers per client, by the flwr-datasets partitioner ``spec`` names.

    Raises:
        DataError: the partitioner cannot split these rows (too few rows for the clients, a Dirichlet draw
            leaving a client under its minimum size ...).
    """
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner, ShardPartitioner

    if spec.scheme != "column" and spec.clients and spec.clients > n:
        raise DataError(f"--clients {spec.clients} is more than the {n} training rows")
    if spec.scheme == "shard" and spec.clients and spec.shards and spec.clients * spec.shards > n:
        raise DataError(f"--partition shard:{spec.shards} with {spec.clients} clients needs at least "
                        f"{spec.clients * spec.shards} rows (one a shard); there are {n}")
    columns: dict[str, list[Any]] = {"row": list(range(n))}
    if labels is not None:
        columns["label"] = list(labels)
    table = datasets.Dataset.from_dict(columns).shuffle(seed=spec.seed)
    n_clients = spec.clients or 1
    partitioner: Any
    if spec.scheme == "iid":
        partitioner = IidPartitioner(num_partitions=n_clients)
    elif spec.scheme == "dirichlet":
        # flwr-datasets' default minimum (10 rows a client), lowered for small tables so a draw can succeed
        partitioner = DirichletPartitioner(n_clients, "label", spec.alpha or 1.0, seed=spec.seed,
                                           min_partition_size=max(1, min(10, n // (4 * n_clients))))
    elif spec.scheme == "shard":
        partitioner = ShardPartitioner(n_clients, "label", num_shards_per_partition=spec.shards, seed=spec.seed)
    else:
        partitioner = NaturalIdPartitioner("label")
    partitioner.dataset = table
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():  # the Dirichlet partitioner warns at every redraw; a failure is raised
            warnings.simplefilter("ignore")
            parts = [sorted(partitioner.load_partition(i)["row"]) for i in range(partitioner.num_partitions)]
    except (ValueError, IndexError, KeyError, ZeroDivisionError) as exc:
        hint = " (use a larger ALPHA or fewer clients)" if spec.scheme == "dirichlet" else ""
        raise DataError(f"--partition {spec.scheme} cannot split {n} rows into {n_clients} clients{hint}: "
                        f"{exc}") from exc
    if spec.scheme == "column":
        natural = {i: str(v) for i, v in partitioner.partition_id_to_natural_id.items()}
        ids = {i: client_name(v) for i, v in natural.items()}
        if len(set(ids.values())) != len(ids):
            raise DataError(f"--by {spec.by}: values {sorted(natural.values())} "
                            "give clashing client ids once made plain names (letters, digits, '_', '-', '.')")
        return dict(sorted(((ids[i], tuple(p)) for i, p in enumerate(parts)), key=lambda kv: kv[0]))
    empty = [i for i, p in enumerate(parts) if not p]
    if empty:
        raise DataError(f"--partition {spec.scheme}:{spec.alpha or spec.shards or ''} left clients {empty} without "
                        f"rows ({n} rows, {n_clients} clients): use fewer clients")
    return {str(i): tuple(p) for i, p in enumerate(parts)}


def build(name: str, records: Sequence[Record], rows: Mapping[str, Sequence[int]],
          tests: Mapping[str, Sequence[Record]], partition: Mapping[str, Any] | None = None,
          labels: Sequence[str] = ()) -> FederatedDataset:
    """Clients from row numbers; each client's task is the most common task among its rows.

    Args:
        name: the data set's name.
        records: the pooled training rows.
        rows: client id -> its row numbers (from :func:`assign`, or read back from ``split.json``).
        tests: task -> its test examples.
        partition: the partition's settings to record (None: the rows are the source's own clients).
        labels: the ``--by`` column per pooled row (the histograms of ``fedmosaic data show``).

    Raises:
        DataError: a row number outside the pooled rows (a ``split.json`` of other data).
    """
    clients = []
    for cid, picked in rows.items():
        bad = [i for i in picked if not 0 <= int(i) < len(records)]
        if bad:
            raise DataError(f"client {cid!r}'s row {bad[0]} is outside the {len(records)} training rows: the split "
                            "was made on other data")
        train = tuple(records[int(i)] for i in picked)
        if not train:
            raise DataError(f"client {cid!r} has no training rows")
        task = Counter(r.task for r in train).most_common(1)[0][0]
        clients.append(ClientData(client_id=cid, task=task, train=train))
    frozen = {t: tuple(rs) for t, rs in tests.items()}
    chosen = {c: tuple(int(i) for i in r) for c, r in rows.items()}
    split = None if partition is None else Split(dict(partition), chosen, len(records), tuple(labels))
    return FederatedDataset(name, tuple(clients), frozen, count_duplicates(tuple(clients), frozen), split=split)


def histogram(dataset: FederatedDataset) -> dict[str, Counter[str]]:
    """Per client, how many of its rows carry each label: the ``--by`` column's of a partition, else the task."""
    split = dataset.split
    if split is not None and split.labels:
        return {c: Counter(split.labels[i] for i in rows) for c, rows in split.rows.items()}
    return {c.client_id: Counter(r.task for r in c.train) for c in dataset.clients}


def write_split(root: Path, split: Split) -> None:
    """Write ``split.json`` into run directory ``root``; a resumed run must find the same split there.

    Raises:
        ValueError: ``root`` already holds another split (the run was trained on other clients).
    """
    path = Path(root) / SPLIT_FILE
    data = split.asdict()
    if path.is_file():
        if json.loads(path.read_text()) != json.loads(json.dumps(data)):
            raise ValueError(f"{path} holds another split of the data: the run was trained on other clients")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, sort_keys=True) + "\n")


def read_split(root: Path) -> dict[str, tuple[int, ...]] | None:
    """The client rows ``split.json`` in run directory ``root`` records (None: the run has none).

    Raises:
        DataError: the file is not a split.
    """
    path = Path(root) / SPLIT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {str(c): tuple(int(i) for i in r) for c, r in data["clients"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path} is not a split file: {exc}") from exc


def make_clients(spec: str, dataset: FederatedDataset | None, columns: str | Mapping[str, str] | None = None,
                 partition: str | None = None, by: str | None = None, clients: int | None = None,
                 partition_seed: int = 0, split: Mapping[str, Sequence[int]] | None = None) -> FederatedDataset:
    """The clients of a table (``dataset`` None) or of a loaded data set's pooled rows.

    Without ``partition`` a table's rows go to the client its ``client`` column names, else to one client
    per task; with it, flwr-datasets splits them (:func:`assign`); ``split`` (a run's ``split.json``)
    gives the rows instead, so the clients are exactly those the run trained.

    Raises:
        DataError: a bad column, partition or split (the file, column and what was found named).
    """
    from training.data.partition import pool
    from training.data.tables import read_table

    spec_ = parse_partition(partition, by, clients, partition_seed) if partition else None
    if dataset is None:
        table = read_table(spec, columns, by)
        records, labels, name = table.train, dict(table.columns), _table_name(spec)
        tests: dict[str, list[Record]] = {}
        for r in table.tests:
            tests.setdefault(r.task, []).append(r)
    else:
        records, name = tuple(pool(dataset)), dataset.name
        labels = {"task": tuple(r.task for r in records), "category": tuple(r.category for r in records),
                  "client": tuple(c.client_id for c in dataset.clients for _ in c.train)}
        tests = {t: list(rs) for t, rs in dataset.tests.items()}
        if by is not None and by not in labels:
            raise DataError(f"--by {by}: {spec}'s records have the fields task, category and client to split by")
    by_labels = labels[by] if by else tuple(r.task for r in records)
    if split is not None:
        rows = {str(c): tuple(r) for c, r in split.items()}
    elif spec_ is not None:
        rows = assign(spec_, by_labels, len(records))
    elif dataset is not None:
        return dataset
    else:
        key = "client" if "client" in labels else "task"
        values = labels["client"] if key == "client" else tuple(r.task for r in records)
        if key == "task" and set(values) == {"all"}:
            raise DataError(f"{spec}: no client column and no task column to make clients from; name one with "
                            "--columns client=COLUMN, or split the rows with --partition iid --clients N")
        grouped: dict[str, list[int]] = {}
        for i, v in enumerate(values):
            grouped.setdefault(client_name(v), []).append(i)
        return build(name, records, dict(sorted(grouped.items())), tests)
    recorded = spec_.asdict() if spec_ is not None else {"scheme": "recorded"}
    return build(name, records, rows, tests, partition=recorded, labels=by_labels)


def _table_name(spec: str) -> str:
    path = Path(spec).expanduser()
    return client_name(path.stem if path.is_file() else path.name if path.exists() else spec.split("/")[-1])
