"""``fedmosaic data``: the data sets ``fedmosaic train --data`` can load, their clients, a few examples, and fetch.

``fedmosaic data list`` shows every named data set: the generated suite (always there) and the
benchmarks (FedDPA datasets 1 and 2, the Dolly split) read from ``FEDMOSAIC_DATA_DIR`` or the user's data
cache, each with its clients, their tasks and example counts, or why it cannot be loaded here.
``fedmosaic data show NAME`` prints each client's size and label histogram, then a few training examples
per client (``--client`` picks one) in the prompt template training uses. ``NAME`` is any ``--data``
spec and the source flags are ``train``'s (``--columns``, ``--partition``, ``--by``, ``--clients``,
``--seed``), so it shows the very split training would make. ``fedmosaic data fetch NAME`` downloads a
benchmark at its pinned commit into the data cache (:mod:`training.data.fetch`). The loaders are
:mod:`training.data`'s; this module only formats what they return.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

from training.data import (
    BENCHMARKS,
    DATA_DIR_HELP,
    DataError,
    FederatedDataset,
    Record,
    cache_data_dir,
    data_dir,
    format_prompt,
    histogram,
    load_dataset,
)

# Every named data set, in the order listed, with what it is (the loaders define what each name reads).
CATALOGUE: dict[str, str] = {
    "generated": "the project's own task families, deterministic from a seed (no download)",
    "feddpa1": "FedDPA dataset 1 (paper 000): 8 Flan tasks, one client each",
    "feddpa2": "FedDPA dataset 2 (paper 000): 8 Flan tasks, one client each",
    "dolly": "Dolly-15k split by category (CC BY-SA 3.0), one client each",
}


def add_data_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic data`` with its ``list``, ``show`` and ``fetch`` actions."""
    from training.data.cli_args import add_source_arguments

    p = sub.add_parser("data", help="list the data sets training can load, show a split and examples, fetch one")
    actions = p.add_subparsers(dest="data_action", required=True)
    actions.add_parser("list", help="every named data set with its clients, tasks and example counts")
    show = actions.add_parser("show", help="each client's size and label histogram, and a few formatted examples")
    show.add_argument("name", help="generated | feddpa1 | feddpa2 | dolly | a folder, table file or cached Hub id "
                                   "(as fedmosaic train --data)")
    show.add_argument("--client", default=None, help="only this client (default: every client)")
    show.add_argument("--n", type=int, default=3, help="examples per client (default: 3; 0: the table alone)")
    show.add_argument("--seed", type=int, default=0, help="the partition's seed (as train's --seed)")
    add_source_arguments(show)
    fetch = actions.add_parser("fetch", help="download a benchmark at its pinned commit and check its SHA-256 sums")
    fetch.add_argument("name", choices=sorted(BENCHMARKS))
    fetch.add_argument("--url", default=None, help="the repository tarball to read (default: GitHub at the pinned "
                                                   "commit); a file:// URL or the path of a tarball fetched by hand")
    fetch.add_argument("--dir", default=None, help=f"the data folder to write into (default: {cache_data_dir()})")
    fetch.add_argument("--force", action="store_true", help="fetch again over a complete copy")
    return p


def run_data(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic data``.

    Raises:
        SystemExit: an unknown data set or client, or a data set that cannot be read (the loader's reason).
    """
    try:
        if args.data_action == "list":
            print(catalogue())
        elif args.data_action == "fetch":
            from training.data.fetch import fetch

            folder = fetch(args.name, args.url, Path(args.dir) if args.dir else None, force=args.force)
            print(f"{args.name}: {len(BENCHMARKS[args.name].sums)} files checked (SHA-256) in {folder}; "
                  f"--data {args.name} reads them from there. Terms: {BENCHMARKS[args.name].licence}")
        else:
            from training.data.cli_args import source_options

            if args.n < 0:
                raise SystemExit(f"fedmosaic data show: --n must be >= 0, got {args.n}")
            dataset = _load(args.name, **source_options(args, args.seed))
            print(split_table(dataset, args.client))
            if args.n:
                print("\n" + show(dataset, args.client, args.n))
    except DataError as exc:
        raise SystemExit(f"fedmosaic data: {exc}") from exc
    return 0


def _load(name: str, **options: Any) -> FederatedDataset:
    """Load a data set quietly: the train/test overlap a loader warns about is reported in the table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_dataset(name, **options)


def split_table(dataset: FederatedDataset, client: str | None = None) -> str:
    """Each client's training size and label histogram (the ``--by`` column's under a partition, else tasks).

    Raises:
        DataError: ``client`` is not one of the data set's clients.
    """
    if client is not None:
        dataset.client(client)
    hist = histogram(dataset)
    split = dataset.split
    by = split.partition.get("by") if split is not None else None
    head = (f"{dataset.name}: {len(dataset.clients)} clients"
            + (f", partition {_describe(split.partition)}" if split is not None else "")
            + (f"; {split.pooled - sum(map(len, split.rows.values()))} of {split.pooled} rows in no client"
               if split is not None and split.pooled > sum(map(len, split.rows.values())) else ""))
    rows = [("client", "train", f"{by or 'task'} histogram")]
    for c in dataset.clients:
        if client is None or c.client_id == client:
            counts = sorted(hist[c.client_id].items(), key=lambda kv: (-kv[1], kv[0]))  # most common first
            rows.append((c.client_id, str(len(c.train)), ", ".join(f"{k or '(empty)'} {v}" for k, v in counts)))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join([head, *("  ".join([r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2]]) for r in rows)])


def _describe(partition: Any) -> str:
    scheme = str(partition.get("scheme"))
    arg = partition.get("alpha") if scheme == "dirichlet" else partition.get("shards") if scheme == "shard" else None
    parts = [f"{scheme}{'' if arg is None else f':{arg}'}"]
    parts += [f"{k} {partition[k]}" for k in ("by", "clients", "seed") if partition.get(k) is not None]
    return ", ".join(parts)


def catalogue() -> str:
    """Every named data set: its description and client table, or why it cannot be loaded here."""
    root = data_dir()
    lines = [f"benchmark data folder: {root if root is not None else f'none ({DATA_DIR_HELP})'}",
             f"data cache (fedmosaic data fetch): {cache_data_dir()}", ""]
    for name, description in CATALOGUE.items():
        lines.append(f"{name}: {description}")
        try:
            lines.extend("  " + row for row in summary(_load(name)).splitlines())
        except DataError as exc:
            lines.append(f"  not available: {exc}")
        lines.append("")
    return "\n".join(lines).rstrip()


def summary(dataset: FederatedDataset) -> str:
    """A table of ``dataset``'s clients: task, training examples, test examples of that task."""
    rows = [("client", "task", "train", "test")]
    rows += [(c.client_id, c.task, str(len(c.train)), str(len(dataset.tests.get(c.task, ()))))
             for c in dataset.clients]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    # names left-aligned, counts right-aligned
    table = ["  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].rjust(widths[3])])
             for r in rows]
    tests = sum(len(records) for records in dataset.tests.values())
    footer = (f"{len(dataset.clients)} clients, {len(dataset.tasks)} test tasks, "
              f"{sum(dataset.num_examples().values())} training and {tests} test examples")
    if dataset.held_out:
        footer += f"; held-out tasks: {', '.join(dataset.held_out)}"
    if dataset.duplicates:
        footer += f"; {dataset.duplicates} test examples also appear in training"
    return "\n".join([*table, footer])


def show(dataset: FederatedDataset, client: str | None = None, n: int = 3) -> str:
    """The first ``n`` training examples of each client (or of ``client``), as training prompts them.

    Raises:
        DataError: ``client`` is not one of the data set's clients (the message lists them).
    """
    clients = [dataset.client(client)] if client is not None else list(dataset.clients)
    blocks = []
    for c in clients:
        for i, record in enumerate(c.train[:n], start=1):
            head = f"== {dataset.name} | client {c.client_id} | task {c.task} | example {i} of {len(c.train)} =="
            blocks.append(f"{head}\n{_example(record)}")
    return "\n\n".join(blocks)


def _example(record: Record) -> str:
    """The prompt in the paper's template followed by the reference answer."""
    return format_prompt(record) + record.output
