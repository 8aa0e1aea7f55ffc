"""The command line's data-source flags (``--columns``, ``--partition``, ``--by``, ``--clients``) -> loader options.

Shared by ``fedmosaic train`` and ``fedmosaic data show``, so both read a source and split it the same way;
the options go into run.json's ``data_options`` (evaluation reloads the data with them) and straight to
:func:`training.data.load_dataset`.
"""

from __future__ import annotations

import argparse
from typing import Any

from training.data.partitioners import PARTITION_HELP, parse_partition
from training.data.records import DataError
from training.data.tables import parse_columns


def add_source_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Register ``--columns``, ``--partition``, ``--by`` and ``--clients``."""
    p.add_argument("--columns", default=None, metavar="ROLE=COLUMN,...",
                   help="which table columns hold what: instruction=Q,input=C,output=A,client=K,task=T,category=G "
                        "(a role not given is read from the column of its own name)")
    p.add_argument("--partition", default=None, metavar="SCHEME",
                   help=f"pool the rows and split them into clients with flwr-datasets: {PARTITION_HELP} "
                        "(seeded by --seed; the split is written to the run directory as split.json)")
    p.add_argument("--by", default=None, metavar="COLUMN",
                   help="the label column dirichlet and shard skew over, or that column makes one client per value")
    p.add_argument("--clients", type=int, default=None, metavar="N", help="clients for iid, dirichlet and shard")


def source_options(args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    """The loader options ``args``' source flags give (empty when none is set).

    Raises:
        DataError: ``--by`` or ``--clients`` without ``--partition``, a bad partition or column mapping, or a
            partition together with ``--clients-per-task``.
    """
    options: dict[str, Any] = {}
    if args.columns:
        options["columns"] = parse_columns(args.columns)
    if args.partition:
        spec = parse_partition(args.partition, args.by, args.clients, seed)
        if int(getattr(args, "clients_per_task", 1) or 1) > 1:
            raise DataError("--partition and --clients-per-task both make clients; use one")
        options.update(partition=args.partition, partition_seed=spec.seed)
        options.update({k: v for k, v in (("by", spec.by), ("clients", spec.clients)) if v is not None})
    elif args.by or args.clients is not None:
        raise DataError(f"--by and --clients choose how --partition splits the rows; add --partition {PARTITION_HELP}")
    return options
