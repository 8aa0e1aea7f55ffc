"""The contract between the run evaluator and whatever generates its answers: items in, predictions out.

:func:`fedmosaic.evaluation.evaluate.evaluate_run` builds :class:`EvalItem` rows (one test example for
one served target) and hands them to an :class:`EvalBackend`; :mod:`fedmosaic.evaluation.stack_backend`
is the backend over the serving stack, and tests pass fakes. Both sides import this module, never each
other's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedmosaic.evaluation.predictions import Prediction

# How ``<client>`` targets are weighted: ``auto`` (instance-wise for methods with FedDPA's instance
# weighting and an embedding index, else fixed), ``instance`` (paper 000 section 4.3) or ``fixed``.
WEIGHTING = ("auto", "instance", "fixed")


@dataclass(frozen=True)
class EvalItem:
    """One example to generate: where its row goes in the cache, which target answers it.

    Attributes:
        checkpoint: the cache's checkpoint (``final`` or ``round-<r>``).
        key: the model key of the table (a client id, ``global``, ``base``).
        task: the test set the example comes from.
        i: the example's index in that test set.
        target: the served target that answers it (``<client>``, ``<client>:local``, ``global`` ...).
        prompt: the prompt text, in the template the run trained with.
        reference: the reference answer.
        tag: how the target is served (:func:`tag_of`), stored with the row.
    """

    checkpoint: str
    key: str
    task: str
    i: int
    target: str
    prompt: str
    reference: str
    tag: str


class EvalBackend(Protocol):
    """What the evaluator needs from a generation backend."""

    base_name: str

    def models(self) -> list[str]:
        """Every served target name."""
        ...

    def describe(self, target: str) -> dict[str, Any]:
        """How ``target`` is served (``mode``, ``adapters``, ``routed``, decoding ...): the cache tag."""
        ...

    def generate(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, Prediction]]:
        """Answer every item, yielding each as soon as it is done (any order)."""
        ...

    def add_adapter(self, name: str, folder: Path) -> None:
        """Serve the PEFT folder ``folder`` as target ``name`` (per-round checkpoints)."""
        ...

    def remove_adapter(self, name: str) -> None:
        """Stop serving ``name``."""
        ...


def tag_of(description: dict[str, Any]) -> str:
    """The cache tag of a target description (stable JSON)."""
    return json.dumps(description, sort_keys=True, default=str)
