"""What an evaluation reads, checked before any model is loaded: the run's clients, the data set, the test set.

An evaluation spends minutes generating before it scores anything, so every option that cannot work
fails here, in one line, first: a run directory without clients, a data set naming none of the run's
clients, a test set without a task, test examples without the reference the metric compares with.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from typing import Any

from adapters.amole_io import ASSIGNMENTS
from adapters.rundir import RunDir
from fedmosaic.evaluation import testsets
from fedmosaic.evaluation.testsets import TestSet
from training.data import FederatedDataset, load_run_dataset
from training.data.records import count_duplicates


class EvalSetupError(ValueError):
    """The run cannot be evaluated as asked (no clients, clients the data set does not name, no results)."""


def run_clients(run: RunDir) -> set[str]:
    """The clients a run trained: its client folders and its AMoLE assignments."""
    clients = set(run.clients())
    path = run.amole / ASSIGNMENTS
    if path.is_file():
        try:
            clients |= set(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            pass  # loading the AMoLE model names the problem precisely; here it only adds names
    return clients


AMOLE_MODELS = ("local", "aggregated")  # a FedAMoLE client's model: its own, or the aggregated pool


def amole_reading(run: RunDir, asked: str | None) -> str | None:
    """Which FedAMoLE model scores the run's clients: ``local`` or ``aggregated`` (None: not a FedAMoLE run).

    ``local`` (paper 002 App. D.1.1: client i's local model at round R) is the default where training
    wrote the clients' own models (``adapters/clients/<id>/amole``, ``export=local``).

    Raises:
        EvalSetupError: ``local`` asked for on a run without them.
    """
    if not (run.amole / ASSIGNMENTS).is_file():
        return None
    own = any((run.client_dir(c) / "amole" / ASSIGNMENTS).is_file() for c in run.clients())
    if asked == "local" and not own:
        raise EvalSetupError(f"{run.root} has no client's own FedAMoLE model (adapters/clients/<id>/amole: trained "
                             "with export=aggregated, or before it existed): use --amole-model aggregated")
    return asked or ("local" if own else "aggregated")


def load_inputs(run: RunDir, cfg: dict[str, Any], *, data: str | None, test: str | None, metric: str,
                limit: int | None) -> tuple[FederatedDataset, TestSet]:
    """The clients' data set carrying the test sets to score, and those test sets.

    Args:
        run: the run directory.
        cfg: its ``run.json``.
        data: a data set spec overriding ``run.json``'s (the clients and their own tasks).
        test: another test set (:func:`.testsets.load_test_set`); None: the data set's own.
        metric: the metric to score with (its references are checked).
        limit: test examples per task that the evaluation uses.

    Raises:
        EvalSetupError: the run has no clients, or the data set names none of them.
        DataError: the data or test set cannot be read, holds no task, or lacks references.
    """
    trained = run_clients(run)
    if not trained and not run.global_adapter.is_dir():
        raise EvalSetupError(f"{run.root} has no clients to evaluate: no adapters/clients/<id>/, adapters/amole/ "
                             "or adapters/global/ (did its training finish?)")
    dataset = load_run_dataset(cfg, data, run_dir=run.root)  # a --partition's split.json: the trained clients
    if trained and not trained & set(dataset.client_ids):
        raise EvalSetupError(f"data set {dataset.name!r} names clients {dataset.client_ids}, none of {run.root}'s "
                             f"{sorted(trained)}: --data must name the run's clients (--test gives other test sets)")
    test_set = testsets.load_test_set(test) if test else testsets.of_dataset(dataset, data)
    testsets.check_test_set(test_set, metric, limit)
    tests = dict(test_set.tests)
    duplicates = count_duplicates(dataset.clients, tests)
    if test and duplicates:  # the run's own test sets were checked when its data set loaded
        warnings.warn(f"test set {test_set.name!r}: {duplicates} examples also appear in the clients' training data",
                      stacklevel=3)
    return replace(dataset, tests=tests, duplicates=duplicates), test_set
