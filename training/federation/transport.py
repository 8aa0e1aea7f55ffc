"""The round loop's transport interface: how one runtime moves a round's instructions to the clients and
their replies back (:mod:`training.federation.rounds` runs the loop; :mod:`training.simulation` and
:mod:`training.flower.transport` implement it).

A transport hands back one :class:`Reply` per client. What it must remember across a server restart
(the Flower transport: which private-state version each client's node must start from) is JSON data
from :meth:`Transport.state_dict`, saved with every round checkpoint and given back by
:meth:`Transport.load_state_dict` when a run resumes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.rundir import RunDir
from training.protocol import FitIns, FitRes
from training.state import ClientState, StateDict


@dataclass(frozen=True)
class Reply:
    """One client's answer to its round's instructions: a result, or the reason it has none.

    Attributes:
        client_id: the client the instructions were for.
        result: what it uploaded (None when it failed).
        error: why it failed (None when it answered).
        seconds: how long it took, where the transport can tell (the simulator; not Flower).
    """

    client_id: str
    result: FitRes | None = None
    error: str | None = None
    seconds: float | None = None


class Transport(ABC):
    """How one runtime moves a round's instructions to the clients and their replies back."""

    def reachable(self, clients: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """The selected clients that can be sent to now, and (client, reason) for the others."""
        return list(clients), []

    @abstractmethod
    def fit(self, round_idx: int, instructions: Mapping[str, FitIns]) -> list[Reply]:
        """Send each client its own instructions; one reply per client, in the order of ``instructions``."""

    def commit(self, round_idx: int, accepted: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """The round's results of ``accepted`` are aggregated: their new private state becomes current.

        A client that answered but is not listed (its reply failed validation) keeps the private state
        it had before the round.
        """

    def private_states(self) -> dict[str, ClientState]:
        """Private tensors the server may checkpoint (the simulator's; a real client keeps its own)."""
        return {}

    def restore(self, private: dict[str, ClientState]) -> None:  # noqa: B027 - optional hook
        """Take back :meth:`private_states` from a checkpoint when a run resumes."""

    def state_dict(self) -> dict[str, Any]:
        """JSON data the transport needs after a server restart (saved with each round's checkpoint)."""
        return {}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Take back :meth:`state_dict` from the checkpoint a run resumes from."""

    def personalize(self, states: Mapping[str, StateDict]) -> None:  # noqa: B027 - optional hook
        """Before :meth:`finalize`: the server's personalised model per client (``Strategy.personal_state``),
        to hand each client in place of the final global state; transports that cannot ignore it."""

    @abstractmethod
    def finalize(self, state: StateDict, run: RunDir) -> dict[str, dict[str, float]]:
        """After the last round: each client's personalization; its local adapter and index into ``run``.

        Returns:
            Client id -> the metrics of its personalization (``ClientAlgorithm.finalize``), for the clients
            that reported.
        """
