"""The generated quick-start task suite: one client per task family, deterministic from a seed.

Same record format as the FedDPA data (paper 000 section 5.1: one task per client, a test set per
task), so the quick start, tests and examples run on a fresh machine with no download. Train and test
examples never share an instruction.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict, Unpack

from training.data.families import FAMILIES
from training.data.records import ClientData, DataError, FederatedDataset, Record


def generate_family(family: str, n_train: int, n_test: int, seed: int = 0) -> tuple[list[Record], list[Record]]:
    """Draw ``n_train`` + ``n_test`` distinct examples of one family (distinct instructions)."""
    if family not in FAMILIES:
        raise DataError(f"unknown task family {family!r}; families: {sorted(FAMILIES)}")
    category, draw = FAMILIES[family]
    rng = random.Random(f"{seed}/{family}")
    seen: set[str] = set()
    records: list[Record] = []
    tries = 0
    while len(records) < n_train + n_test:
        tries += 1
        if tries > 50 * (n_train + n_test) + 1000:
            raise DataError(f"family {family!r} cannot produce {n_train + n_test} distinct examples")
        instruction, output = draw(rng)
        if instruction in seen:
            continue
        seen.add(instruction)
        records.append(Record(instruction=instruction, output=output, task=family, category=category))
    return records[:n_train], records[n_train:]


class SuiteOptions(TypedDict, total=False):
    """:func:`generate_suite`'s options, as :func:`write_suite` passes them on."""

    seed: int
    n_train: int
    n_test: int
    families: Sequence[str] | None


def generate_suite(
    seed: int = 0, n_train: int = 300, n_test: int = 50, families: Sequence[str] | None = None
) -> FederatedDataset:
    """Return the suite: one client per family (client id = family name), one test set per family."""
    if n_train < 1 or n_test < 0:
        raise DataError(f"need n_train >= 1 and n_test >= 0, got {n_train}, {n_test}")
    names = list(families) if families else list(FAMILIES)
    clients, tests = [], {}
    for family in names:
        train, test = generate_family(family, n_train, n_test, seed)
        clients.append(ClientData(client_id=family, task=family, train=tuple(train)))
        tests[family] = tuple(test)
    return FederatedDataset(name=f"generated-s{seed}", clients=tuple(clients), tests=tests)


def write_suite(folder: str | Path, **options: Unpack[SuiteOptions]) -> Path:
    """Write the suite in the generic folder layout (``train/<client>.jsonl``, ``test/<task>.jsonl``)."""
    dataset = generate_suite(**options)
    root = Path(folder)
    for sub, groups in (("train", {c.client_id: c.train for c in dataset.clients}), ("test", dataset.tests)):
        (root / sub).mkdir(parents=True, exist_ok=True)
        for name, records in groups.items():
            lines = [json.dumps({"instruction": r.instruction, "input": r.input, "output": r.output,
                                 "task": r.task, "category": r.category}) for r in records]
            (root / sub / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root
