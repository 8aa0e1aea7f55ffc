"""Records and federated datasets: the in-memory shape every loader, partition and method shares.

FedDPA (paper 000, section 5.1 and appendix A.1): each client holds the training data of one task (or
a partition of it), and every task has its own test set, so each client's personalized model can be
scored on its own task (personalization) and on all tasks (test-time personalization).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """A data set, file or record cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Record:
    """One instruction example.

    Attributes:
        instruction: the instruction (FedDPA's data has the input already folded in).
        output: the reference response.
        input: optional context (Dolly, Alpaca); folded into the prompt when non-empty.
        task: the task name (Flan task, Dolly category, generated family).
        category: the task category.
    """

    instruction: str
    output: str
    input: str = ""
    task: str = ""
    category: str = ""

    def key(self) -> tuple[str, str]:
        """Identity used to find the same question in train and test (instruction and input)."""
        return (self.instruction.strip(), self.input.strip())


@dataclass(frozen=True)
class ClientData:
    """One client's data.

    Attributes:
        client_id: a stable id (``"0"``..``"7"`` for FedDPA, family names for the generated suite).
        task: the client's own task (its personalization test set).
        train: local training examples.
        validation: the client's held-out examples (``hold_out`` data option): never trained on, read
            once at the end of training to check whether its local adapter helps (``training.federation.local_gate``).
    """

    client_id: str
    task: str
    train: tuple[Record, ...]
    validation: tuple[Record, ...] = ()

    def __post_init__(self) -> None:
        if not self.train:
            raise DataError(f"client {self.client_id!r} has no training examples")
        if "/" in self.client_id or self.client_id in ("", ".", "..") or ":" in self.client_id:
            raise DataError(f"client id {self.client_id!r} must be a plain name (no '/', ':' or dots only)")


@dataclass(frozen=True)
class Split:
    """Which rows of a pooled table each client got (``--partition``; written to the run directory).

    Attributes:
        partition: how the rows were split (scheme, ``by`` column, clients, seed: ``PartitionSpec.asdict``).
        rows: client id -> its row numbers in the pooled training rows (0-based, ascending).
        pooled: the number of pooled rows (rows no client got, e.g. a shard partition's remainder, are dropped).
        labels: the ``--by`` column's value of every pooled row (for the label histograms; not written).
    """

    partition: Mapping[str, Any]
    rows: Mapping[str, tuple[int, ...]]
    pooled: int
    labels: tuple[str, ...] = field(default=(), compare=False)

    def asdict(self) -> dict[str, Any]:
        """JSON for ``split.json``."""
        return {"partition": dict(self.partition), "pooled": self.pooled,
                "clients": {c: list(r) for c, r in self.rows.items()}}


@dataclass(frozen=True)
class FederatedDataset:
    """Clients with local training data plus one test set per task.

    Attributes:
        name: a short name for run directories and tables.
        clients: the clients, in a fixed order.
        tests: task name -> its test examples.
        duplicates: test examples that also appear in some client's training data (warned at load).
        held_out: tasks with a test set but no training client (leave-one-task-out).
        split: the rows each client got when ``--partition`` made the clients (None: the source's own clients).
    """

    name: str
    clients: tuple[ClientData, ...]
    tests: dict[str, tuple[Record, ...]] = field(default_factory=dict)
    duplicates: int = 0
    held_out: tuple[str, ...] = ()
    split: Split | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.clients:
            raise DataError(f"data set {self.name!r} has no clients")
        ids = [c.client_id for c in self.clients]
        if len(set(ids)) != len(ids):
            raise DataError(f"data set {self.name!r} has duplicate client ids: {ids}")

    @property
    def client_ids(self) -> list[str]:
        """Client ids in order."""
        return [c.client_id for c in self.clients]

    @property
    def tasks(self) -> list[str]:
        """Tasks with a test set, in a stable order (clients' tasks first)."""
        seen = [c.task for c in self.clients if c.task in self.tests]
        ordered = list(dict.fromkeys(seen))
        return ordered + sorted(t for t in self.tests if t not in ordered)

    def client(self, client_id: str) -> ClientData:
        """Return the client with this id."""
        for c in self.clients:
            if c.client_id == client_id:
                return c
        raise DataError(f"data set {self.name!r} has no client {client_id!r}; clients: {self.client_ids}")

    def task_of(self, client_id: str) -> str:
        """Return the task of a client."""
        return self.client(client_id).task

    def num_examples(self) -> dict[str, int]:
        """Training examples per client."""
        return {c.client_id: len(c.train) for c in self.clients}


def count_duplicates(clients: tuple[ClientData, ...], tests: dict[str, tuple[Record, ...]]) -> int:
    """Count test examples whose instruction and input also appear in some client's training data."""
    train_keys = {r.key() for c in clients for r in c.train}
    return sum(1 for records in tests.values() for r in records if r.key() in train_keys)
