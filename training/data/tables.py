"""Tables: a CSV/TSV, JSON/JSONL or Parquet file or folder, a ``save_to_disk`` folder or a cached Hub data set.

Every format is read by the ``datasets`` library into rows; ``--columns instruction=Q,output=A,client=K``
says which column plays which role (:data:`ROLES`; a role not mapped is read from the column of its own
name). The rows are checked before anything trains: a mapping to a column the file lacks, a missing or
empty ``instruction``/``output`` column and a CSV read as one column (a wrong delimiter) each raise one
:class:`DataError` naming the file, the column and what was found. Rows become :class:`Table` records;
:mod:`training.data.partitioners` turns them into clients. A Hub id is read from the local Hugging Face
cache only (no network at run time).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.data.records import DataError, Record

ROLES = ("instruction", "input", "output", "client", "task", "category")
REQUIRED = ("instruction", "output")
# file suffix -> (``datasets`` builder, its options): CSV cells stay text, an empty cell is "" (not NaN)
FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".csv": ("csv", {"keep_default_na": False}), ".tsv": ("csv", {"keep_default_na": False, "delimiter": "\t"}),
    ".json": ("json", {}), ".jsonl": ("json", {}), ".parquet": ("parquet", {}),
}
DISK_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # what save_to_disk writes
_HUB_ID = re.compile(r"^(hf:)?[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Table:
    """A table's rows as records, with every column's text for ``--by``.

    Attributes:
        source: the file, folder or Hub id (errors name it).
        train: the training rows.
        columns: column name -> one text per training row (the raw columns and the roles).
        tests: the test split's rows (empty when the source has none).
    """

    source: str
    train: tuple[Record, ...]
    columns: Mapping[str, tuple[str, ...]]
    tests: tuple[Record, ...] = ()


def parse_columns(text: str | Mapping[str, str] | None) -> dict[str, str]:
    """``instruction=Q,input=C,output=A,client=K,task=T`` -> ``{role: column}``.

    Raises:
        DataError: an item without ``=``, an unknown role (the roles listed) or a role given twice.
    """
    if not text:
        return {}
    items = text.items() if isinstance(text, Mapping) else (
        item.partition("=")[::2] if "=" in item else (item, None) for item in str(text).split(",") if item.strip())
    mapping: dict[str, str] = {}
    for role, column in items:
        role = role.strip()
        if column is None or not str(column).strip():
            raise DataError(f"--columns expects ROLE=COLUMN items, got {role!r}")
        if role not in ROLES:
            raise DataError(f"--columns: unknown role {role!r}; the roles are {', '.join(ROLES)}")
        if role in mapping:
            raise DataError(f"--columns gives {role!r} twice")
        mapping[role] = str(column).strip()
    return mapping


def is_table_source(spec: str) -> bool:
    """Whether ``spec`` is a table file, a folder of table files, a ``save_to_disk`` folder or a Hub id."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.suffix.lower() in FORMATS
    if path.is_dir():
        return any((path / m).is_file() for m in DISK_MARKERS) or bool(_folder_files(path))
    return bool(_HUB_ID.match(spec))


def read_table(spec: str, columns: str | Mapping[str, str] | None = None, by: str | None = None) -> Table:
    """Read ``spec`` with ``datasets`` and map its columns to records.

    A record's task is its ``task`` column, else its ``category``, else the ``by`` column, else its ``client``
    column, else ``"all"``.

    Raises:
        DataError: the source cannot be read, or a column is wrong (file, column and what was found named).
    """
    mapping = parse_columns(columns)
    splits, where = _load(spec)
    train_name = "train" if "train" in splits else next(iter(splits))
    train = _rows(splits[train_name], where.get(train_name, spec), mapping, by)
    tests = _rows(splits["test"], where.get("test", spec), mapping, by)[0] if "test" in splits else ()
    return Table(spec, train[0], train[1], tests)


def _rows(data: Any, where: str, mapping: Mapping[str, str], by: str | None,
          ) -> tuple[tuple[Record, ...], dict[str, tuple[str, ...]]]:
    """One split's rows as records, after every column check."""
    found = list(data.column_names)
    if len(found) == 1 and where.lower().endswith((".csv", ".tsv")):
        seps = [s for s in (";", "\t", "|", ",") if s in found[0]]
        if seps:
            used = "tab" if where.lower().endswith(".tsv") else "','"
            raise DataError(f"{where}: read as one column {found[0]!r} with the {used} delimiter, but the header "
                            f"holds {seps[0]!r}: a wrong delimiter? Save it comma-separated as .csv or "
                            "tab-separated as .tsv")
    for role, column in mapping.items():
        if column not in found:
            raise DataError(f"{where}: --columns {role}={column} names column {column!r}, which is not there; "
                            f"columns found: {found}")
    n = data.num_rows
    values = {c: tuple("" if v is None else str(v) for v in data[c]) for c in found}
    role_values: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        column = mapping.get(role, role)
        if column in values:
            role_values[role] = values[column]
        elif role in REQUIRED:
            raise DataError(f"{where}: no {role!r} column; columns found: {found}; name the column that holds the "
                            f"{role} with --columns {role}=COLUMN")
    if n == 0:
        raise DataError(f"{where}: no rows (columns found: {found})")
    for role in ("instruction", "output", "client", "task"):
        if role not in role_values:
            continue
        empty = [i + 1 for i, v in enumerate(role_values[role]) if not v.strip()]
        if empty:
            column = mapping.get(role, role)
            every = "every row" if len(empty) == n else f"{len(empty)} of {n} rows (rows {_listed(empty)})"
            raise DataError(f"{where}: column {column!r} ({role}) is empty in {every}")
    labels = {**values, **role_values}
    if by is not None and by not in labels:
        raise DataError(f"{where}: --by {by} names column {by!r}, which is not there; columns found: {found}")
    sources = [role_values.get("task"), role_values.get("category"), labels.get(by or ""), role_values.get("client")]
    blank = ("",) * n
    records = tuple(Record(instruction=role_values["instruction"][i], output=role_values["output"][i],
                           input=role_values.get("input", blank)[i],
                           task=next((s[i] for s in sources if s is not None and s[i]), "all"),
                           category=role_values.get("category", blank)[i]) for i in range(n))
    return records, labels


def _listed(rows: list[int], k: int = 5) -> str:
    return ", ".join(map(str, rows[:k])) + (", ..." if len(rows) > k else "")


def _folder_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS
                  and not p.name.startswith(".") and "manifest" not in p.name)


def _load(spec: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``spec``'s splits as ``datasets.Dataset`` objects, and the file each split came from (for errors)."""
    path = Path(spec).expanduser()
    with _quiet_offline():
        import datasets

        try:
            if path.is_dir() and any((path / m).is_file() for m in DISK_MARKERS):
                loaded = datasets.load_from_disk(str(path))
                splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
                return splits, {k: str(path) for k in splits}
            if path.exists():
                files = [path] if path.is_file() else _folder_files(path)
                if not files:
                    raise DataError(f"{path} holds no .csv, .tsv, .json, .jsonl or .parquet file")
                kinds = {f.suffix.lower().replace(".jsonl", ".json") for f in files}
                if len(kinds) > 1:
                    raise DataError(f"{path} mixes file formats ({', '.join(sorted(f.suffix for f in files))}); "
                                    "keep one format per folder")
                builder, kwargs = FORMATS[files[0].suffix.lower()]
                test = [str(f) for f in files if "test" in f.stem.lower()]
                data_files = {"train": [str(f) for f in files if str(f) not in test]}
                if test:
                    data_files["test"] = test
                if not data_files["train"]:
                    raise DataError(f"{path} holds only test files ({', '.join(test)})")
                splits = dict(datasets.load_dataset(builder, data_files=data_files, **kwargs))
                return splits, {k: v[0] if len(v) == 1 else str(path) for k, v in data_files.items()}
            return _hub(spec.removeprefix("hf:"), datasets), {}
        except DataError:
            raise
        except Exception as exc:  # the library's parse errors (bad JSON, a truncated Parquet file): one line
            raise DataError(f"{spec} cannot be read: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc


def _hub(repo: str, datasets: Any) -> dict[str, Any]:
    """A Hub data set from the local cache: ``datasets``' own, else the raw files ``huggingface_hub`` cached."""
    try:
        return dict(datasets.load_dataset(repo))
    except Exception:  # noqa: BLE001 - not in datasets' cache: try the hub file cache below
        pass
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except Exception as exc:
        raise DataError(f"{repo!r} is not a file or folder, and not a data set in the local Hugging Face cache "
                        f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}); fedmosaic never downloads at run "
                        f"time: run datasets.load_dataset({repo!r}) once with network, or give a local path") \
            from exc
    splits, _ = _load(folder)
    return splits


@contextlib.contextmanager
def _quiet_offline() -> Iterator[None]:
    """No network and no progress bars while ``datasets`` reads (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    import datasets
    import huggingface_hub.constants as hub

    before = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE, datasets.is_progress_bar_enabled())
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before[0], before[1]
        if before[2]:
            datasets.enable_progress_bars()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
