"""``fedmosaic reproduce``'s command line: its options -> :class:`.options.Table1Options`, the harness or the tables."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedmosaic.reproduce import results, table1
from fedmosaic.reproduce.cells import LABELS
from fedmosaic.reproduce.options import DEFAULT_METHODS, HarnessFileError, Table1Options


def add_reproduce_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic reproduce`` (its description: :mod:`fedmosaic.reproduce.table1`'s)."""
    p = sub.add_parser("reproduce", help="paper 000 Table 1: train, evaluate and tabulate its cells",
                       description=table1.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated: " + ",".join(LABELS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--preset", default=None, help="a training preset (default: repro, else small)")
    p.add_argument("--data", default="feddpa1", help="feddpa1 | generated (any spec training accepts)")
    p.add_argument("--data-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a loader option, e.g. n_train=4 for the generated suite")
    p.add_argument("--leave-out", default=None, metavar="TASKS", help="FedOA's held-out tasks (paper 001 protocol)")
    p.add_argument("--rounds", type=int, default=None, help="default: each method's rounds under --preset")
    p.add_argument("--limit", type=int, default=None, help="test examples per task (default: all)")
    p.add_argument("--ttp-limit", type=int, default=None, metavar="N",
                   help="a client's model on the other tasks (the TTP column only): the first N examples of each")
    p.add_argument("--num-beams", type=int, default=1, help="the FedDPA reference: 4")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the FedDPA reference: 80")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--metric", default="rouge1")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="runs/table1")
    p.add_argument("--option", action="append", default=[], metavar="METHOD:KEY=VALUE")
    p.add_argument("--tables-only", action="store_true",
                   help="rewrite <out>/table1.md and <out>/README.md from the cells already in <out> (those made "
                        "with the evaluation options given; the training settings are the folder's "
                        "table1_settings.json), training and evaluating nothing")
    return p


def options(args: argparse.Namespace) -> Table1Options:
    """The parsed arguments as :class:`Table1Options`."""
    return Table1Options(
        methods=args.methods, seeds=tuple(args.seeds), preset=args.preset, data=args.data,
        data_option=tuple(args.data_option), leave_out=args.leave_out, rounds=args.rounds, limit=args.limit,
        ttp_limit=args.ttp_limit, num_beams=args.num_beams, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, metric=args.metric, model=args.model, dtype=args.dtype, device=args.device,
        out=args.out, option=tuple(args.option))


def run_reproduce(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic reproduce``: 1 when a cell failed (the others are made and tabulated)."""
    opts = options(args)
    try:
        if args.tables_only:
            for path in results.rewrite(Path(opts.out), opts):
                print(path)
            return 0
        return 1 if table1.reproduce(opts)["failed"] else 0
    except HarnessFileError as exc:  # a damaged file outside any one cell's work: named, nothing written
        raise SystemExit(f"fedmosaic reproduce: {exc}") from exc
