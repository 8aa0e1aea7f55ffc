"""``fedmosaic data``: the data sets ``fedmosaic train --data`` can load, their clients, and a few examples.

``fedmosaic data list`` shows every named data set: the generated suite (always there) and the
benchmarks read from ``FEDMOSAIC_DATA_DIR`` (FedDPA datasets 1 and 2, the Dolly split), each with its
clients, their tasks and example counts, or why it cannot be loaded here. ``fedmosaic data show NAME``
prints a few training examples per client (``--client`` picks one) in the prompt template training
uses. ``NAME`` is any ``--data`` spec, so a folder of your own works too. The loaders are
:mod:`training.data`'s; this module only formats what they return.
"""

from __future__ import annotations

import argparse
import warnings

from training.data import DATA_DIR_HELP, DataError, FederatedDataset, Record, data_dir, format_prompt, load_dataset

# Every named data set, in the order listed, with what it is (the loaders define what each name reads).
CATALOGUE: dict[str, str] = {
    "generated": "the project's own task families, deterministic from a seed (no download)",
    "feddpa1": "FedDPA dataset 1 (paper 000): 8 Flan tasks, one client each",
    "feddpa2": "FedDPA dataset 2 (paper 000): 8 Flan tasks, one client each",
    "dolly": "Dolly-15k split by category (CC BY-SA 3.0), one client each",
}


def add_data_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic data`` with its ``list`` and ``show`` actions."""
    p = sub.add_parser("data", help="list the data sets training can load, show a few examples")
    actions = p.add_subparsers(dest="data_action", required=True)
    actions.add_parser("list", help="every named data set with its clients, tasks and example counts")
    show = actions.add_parser("show", help="a few formatted training examples of a data set")
    show.add_argument("name", help="generated | feddpa1 | feddpa2 | dolly | a folder (as fedmosaic train --data)")
    show.add_argument("--client", default=None, help="only this client (default: every client)")
    show.add_argument("--n", type=int, default=3, help="examples per client (default: 3)")
    return p


def run_data(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic data``.

    Raises:
        SystemExit: an unknown data set or client, or a data set that cannot be read (the loader's reason).
    """
    try:
        if args.data_action == "list":
            print(catalogue())
        else:
            if args.n < 1:
                raise SystemExit(f"fedmosaic data show: --n must be >= 1, got {args.n}")
            print(show(_load(args.name), args.client, args.n))
    except DataError as exc:
        raise SystemExit(f"fedmosaic data: {exc}") from exc
    return 0


def _load(name: str) -> FederatedDataset:
    """Load a data set quietly: the train/test overlap a loader warns about is reported in the table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_dataset(name)


def catalogue() -> str:
    """Every named data set: its description and client table, or why it cannot be loaded here."""
    root = data_dir()
    lines = [f"benchmark data folder: {root if root is not None else f'none ({DATA_DIR_HELP})'}", ""]
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
