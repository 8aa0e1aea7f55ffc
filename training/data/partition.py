"""Partitions of a federated data set: one task per client, k clients per task, Dirichlet, leave-out.

* one task per client: FedDPA (paper 000, section 5.1) — the loaders' default;
* a task split into k equal clients with a per-round sample rate: paper 000 appendix A.1 (40 clients
  = 8 tasks x 5, sample rate 0.2-1 per task per round);
* Dirichlet label skew over a category field: FedAMoLE (paper 002, section 5.1; docs/methods.md 1.9);
* leave-one-task-out: FedOA (paper 001, section 5.1), the held-out tasks only tested;
* a held-out share of each client's examples, its validation set (our addition: the check of a client's
  local adapter at the end of training, ``training.federation.local_gate``).

Every function keeps each training example exactly once (tested).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from training.data.records import ClientData, DataError, FederatedDataset, Record


def split_tasks(dataset: FederatedDataset, k: int, seed: int = 0) -> FederatedDataset:
    """Split every client's data into ``k`` equal shuffled clients ``<id>-<j>`` (remainder to the first)."""
    if k < 1:
        raise DataError(f"k must be >= 1, got {k}")
    rng = random.Random(seed)
    clients = []
    for c in dataset.clients:
        if len(c.train) < k:
            raise DataError(f"client {c.client_id!r} has {len(c.train)} examples, fewer than k={k}")
        order = list(c.train)
        rng.shuffle(order)
        for j in range(k):
            clients.append(ClientData(client_id=f"{c.client_id}-{j}", task=c.task, train=tuple(order[j::k]),
                                      validation=c.validation[j::k]))
    name = dataset.name + f"-x{k}"
    return FederatedDataset(name, tuple(clients), dataset.tests, dataset.duplicates, dataset.held_out)


def sample_clients(dataset: FederatedDataset, rate: float, round_idx: int, seed: int = 0) -> list[str]:
    """Per task, sample ``max(1, round(rate * k))`` of its k clients for this round (paper 000 A.1).

    Deterministic in (seed, round); the result keeps the data set's client order.
    """
    if not 0.0 < rate <= 1.0:
        raise DataError(f"sample rate must be in (0, 1], got {rate}")
    rng = random.Random(seed * 1_000_003 + round_idx)
    chosen: set[str] = set()
    by_task: dict[str, list[str]] = {}
    for c in dataset.clients:
        by_task.setdefault(c.task, []).append(c.client_id)
    for ids in by_task.values():
        n = max(1, round(rate * len(ids)))
        chosen.update(rng.sample(ids, n))
    return [c for c in dataset.client_ids if c in chosen]


def dirichlet(
    records: Sequence[Record], n_clients: int, alpha: float, seed: int = 0, min_size: int = 10,
    label: str = "category", tests: dict[str, tuple[Record, ...]] | None = None, name: str = "dirichlet",
    max_tries: int = 1000,
) -> FederatedDataset:
    """Dirichlet label skew: per class, Dir(alpha) proportions over clients (docs/methods.md 1.9).

    Clients already holding ``len(records) / n_clients`` examples get no more of the next class, and
    the draw is repeated until every client has at least ``min_size`` examples.
    """
    if n_clients < 1 or alpha <= 0:
        raise DataError(f"need n_clients >= 1 and alpha > 0, got {n_clients}, {alpha}")
    if len(records) < n_clients * min_size:
        raise DataError(f"{len(records)} examples cannot give {n_clients} clients {min_size} each")
    labels = np.array([getattr(r, label) for r in records])
    classes = sorted(set(labels.tolist()))
    rng = np.random.default_rng(seed)
    cap = len(records) / n_clients
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for cls in classes:
            idx = np.flatnonzero(labels == cls)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(n_clients, alpha))
            p = np.array([pj * (len(parts[j]) < cap) for j, pj in enumerate(p)])
            p = p / p.sum() if p.sum() > 0 else np.full(n_clients, 1.0 / n_clients)
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for j, chunk in enumerate(np.split(idx, cuts)):
                parts[j].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            break
    else:
        raise DataError(f"no Dirichlet draw gave every client {min_size} examples in {max_tries} tries")
    clients = []
    for j, part in enumerate(parts):
        train = tuple(records[i] for i in sorted(part))
        major = max(set(getattr(r, label) for r in train), key=lambda c: sum(getattr(r, label) == c for r in train))
        clients.append(ClientData(client_id=str(j), task=major, train=train))
    return FederatedDataset(name, tuple(clients), dict(tests or {}))


def leave_out(dataset: FederatedDataset, held_out: Sequence[str]) -> FederatedDataset:
    """Drop the clients of the ``held_out`` tasks; their test sets stay (paper 001's OOD tasks)."""
    unknown = set(held_out) - {c.task for c in dataset.clients}
    if unknown:
        raise DataError(f"cannot hold out unknown tasks {sorted(unknown)}")
    clients = tuple(c for c in dataset.clients if c.task not in held_out)
    return FederatedDataset(dataset.name + "-loo", clients, dataset.tests, dataset.duplicates, tuple(held_out),
                            dataset.split)


def hold_out(dataset: FederatedDataset, share: float, seed: int = 0) -> FederatedDataset:
    """Move ``share`` of each client's training examples into its ``validation`` set.

    Each client holds out ``max(1, round(share * N))`` of its N examples, drawn by a generator seeded
    with (``seed``, client id), so every runtime (simulator, Flower node, ``fedmosaic calibrate``) draws
    the same split; the examples keep their order in both parts.

    Raises:
        DataError: ``share`` outside (0, 0.5], or a client with fewer than 2 examples.
    """
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 < share <= 0.5:
        raise DataError(f"hold_out must be a share of each client's examples in (0, 0.5], got {share!r}")
    clients = []
    for c in dataset.clients:
        n = len(c.train)
        if n < 2:
            raise DataError(f"client {c.client_id!r} has {n} example(s): too few to hold any out")
        k = max(1, round(share * n))
        picked = set(random.Random(f"{seed}:{c.client_id}").sample(range(n), k))
        clients.append(ClientData(c.client_id, c.task, tuple(r for i, r in enumerate(c.train) if i not in picked),
                                  c.validation + tuple(r for i, r in enumerate(c.train) if i in picked)))
    return FederatedDataset(dataset.name, tuple(clients), dataset.tests, dataset.duplicates, dataset.held_out,
                            dataset.split)


def pool(dataset: FederatedDataset) -> list[Record]:
    """All training examples of all clients, in client order (for Dirichlet and Centralized)."""
    return [r for c in dataset.clients for r in c.train]
