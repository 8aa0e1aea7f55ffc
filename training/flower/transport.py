"""The Flower bridge's server side: the round loop's transport over a ServerApp's Grid (flwr 1.41).

:mod:`training.federation.rounds` runs the loop in the ServerApp; this transport moves its messages ("write the
loop yourself", anchors/federated.md 2.2):

1. a ``query.identify`` message to every node it does not know yet: each answers with its
   ``partition-id`` and the data set client it serves, giving the client -> node map
   (:func:`identify_nodes`). The first round waits (up to the timeout) until every selected client's
   node is there; later rounds ask only nodes that joined since (a restarted SuperNode comes back
   under a new node id and takes its client over) and forget nodes that went offline;
2. each round, one ``train`` message per selected client to its node, carrying ITS instructions (the
   wire format is :mod:`training.flower.messages`) and the private-state version it must start from:
   the round of its last aggregated reply (:mod:`training.flower.node_state`), all sent and collected with the
   Grid's ``send_and_receive``; an error reply, a malformed one, one from the wrong client or none
   within the timeout is that client's failure for the round (:func:`exchange`);
3. at the end, a ``train.finalize`` message for methods with a local adapter (each node personalizes
   and, for FedDPA, embeds its own instances), then the local adapters and indexes are gathered from
   the nodes' disk mirror (``<client_dir>/<client>/final/``) into the run directory.

The version map (and the recent rounds' maps, which say what nodes must keep) is the transport's
checkpointed state, so a resumed server addresses every node exactly as the uninterrupted one would.
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid
from safetensors.torch import load_file

from adapters import LoraConfig, write_adapter_folder
from adapters.rundir import RunDir
from training.federation import durable
from training.federation.transport import Reply, Transport
from training.flower.messages import FINALIZE, IDENTIFY, fit_content, read_identity, read_reply_content
from training.flower.node_state import FINAL
from training.protocol import FitIns
from training.state import StateDict

logger = logging.getLogger(__name__)


def identify_nodes(grid: Grid, node_ids: Sequence[int], timeout: float) -> dict[str, int]:
    """client id -> node id, from one ``query.identify`` exchange with ``node_ids``.

    A node that answers with an error, or not in time, is logged and left out; when two nodes claim one
    client, the one listed later (the newer) wins.
    """
    asked = [Message(content=RecordDict(), dst_node_id=nid, message_type=IDENTIFY) for nid in node_ids]
    nodes: dict[str, int] = {}
    for reply in grid.send_and_receive(asked, timeout=timeout) if asked else []:
        src = int(reply.metadata.src_node_id)
        if reply.has_error():
            logger.warning("node %d did not identify itself: %s", src, reply.error.reason)
            continue
        try:
            partition, cid = read_identity(reply.content)
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("node %d answered identify with a malformed reply: %s", src, exc)
            continue
        if cid in nodes:
            logger.warning("nodes %d and %d both serve client %r (partition-id %d)", nodes[cid], src, cid, partition)
        if cid not in nodes or list(node_ids).index(src) > list(node_ids).index(nodes[cid]):
            nodes[cid] = src
    return nodes


def exchange(grid: Grid, sends: Mapping[str, tuple[int, FitIns]], timeout: float, message_type: str = MessageType.TRAIN,
             versions: Mapping[str, tuple[int, int]] | None = None) -> list[Reply]:
    """Send each client its own instructions in one message to its node; collect the replies.

    Args:
        grid: the ServerApp's grid.
        sends: client id -> (node id, that client's FitIns).
        timeout: seconds to wait for the replies.
        message_type: ``train`` (a round) or ``train.finalize``.
        versions: client id -> (private-state version to start from, oldest to keep); absent: (-1, -1).

    Returns:
        One reply per client of ``sends``, in its order: the result, or the reason there is none (an
        error reply, a malformed one, a reply from the wrong client, no reply in time).
    """
    versions = versions or {}
    messages = [Message(content=fit_content(ins, cid, *versions.get(cid, (-1, -1))), dst_node_id=nid,
                        message_type=message_type) for cid, (nid, ins) in sends.items()]
    client_of = {nid: cid for cid, (nid, _) in sends.items()}
    got: dict[str, Reply] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        cid = client_of.get(int(reply.metadata.src_node_id), str(reply.metadata.src_node_id))
        if reply.has_error():
            got[cid] = Reply(cid, error=str(reply.error.reason))
            continue
        try:
            res = read_reply_content(reply.content)
        except (KeyError, TypeError, ValueError) as exc:  # not our wire format: this client's failure only
            got[cid] = Reply(cid, error=f"malformed reply: {type(exc).__name__}: {exc}")
            continue
        if res.client_id != cid:
            got[cid] = Reply(cid, error=f"the node answered as client {res.client_id!r}")
            continue
        got[cid] = Reply(cid, res)
    # replies come as nodes finish: back to the selection order
    return [got.get(c, Reply(c, error=f"no reply within {timeout} s")) for c in sends]


class FlowerTransport(Transport):
    """The loop's messages through a ServerApp's Grid, one node per client.

    Args:
        grid: the ServerApp's grid.
        timeout: seconds to wait for the replies of one exchange (and for the nodes before the first round).
        has_local: the method's clients end with a local adapter (they get a ``train.finalize``).
        client_dir: where the nodes mirror their private state (``<client>/final/`` after the last round).
        lora: the LoRA config of the local PEFT folders.
        base_model: the base model name recorded in them.
        keep: the round loop's ``keep_strategy``: how many recent rounds are resume points (0: all), so
            how far back nodes keep private-state versions (at least two rounds: one torn newest
            checkpoint can fall back).
    """

    def __init__(self, grid: Grid, timeout: float, has_local: bool, client_dir: Path, lora: LoraConfig,
                 base_model: str, keep: int = 1) -> None:
        self.grid, self.timeout, self.has_local, self.client_dir = grid, timeout, has_local, client_dir
        self.lora, self.base_model = lora, base_model
        self.nodes: dict[str, int] = {}
        self.committed: dict[str, int] = {}  # client -> round of its last aggregated reply
        self.history: deque[dict[str, int]] = deque(maxlen=max(2, keep) if keep > 0 else None)
        self._waited = False
        self._personal: dict[str, StateDict] = {}  # the server's personalised model per client (pFedSeq)

    def _refresh(self) -> None:
        online = [int(n) for n in sorted(self.grid.get_node_ids())]
        self.nodes = {c: n for c, n in self.nodes.items() if n in online}  # offline nodes are gone
        new = [n for n in online if n not in self.nodes.values()]
        for cid, nid in identify_nodes(self.grid, new, min(self.timeout, 60.0)).items():
            if cid in self.nodes:
                logger.info("client %s moved from node %d to node %d", cid, self.nodes[cid], nid)
            self.nodes[cid] = nid

    def reachable(self, clients: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        deadline = time.monotonic() + (0.0 if self._waited else self.timeout)
        self._refresh()
        while any(c not in self.nodes for c in clients) and time.monotonic() < deadline:
            time.sleep(1.0)  # before the first round: a deployment's SuperNodes may still be connecting
            self._refresh()
        self._waited = True
        present = [c for c in clients if c in self.nodes]
        return present, [(c, "no connected node serves this client") for c in clients if c not in self.nodes]

    def _versions(self, clients: Sequence[str]) -> dict[str, tuple[int, int]]:
        full = self.history.maxlen is not None and len(self.history) == self.history.maxlen
        return {c: (self.committed.get(c, -1), self.history[0].get(c, -1) if full else -1) for c in clients}

    def fit(self, round_idx: int, instructions: Mapping[str, FitIns]) -> list[Reply]:
        return exchange(self.grid, {c: (self.nodes[c], ins) for c, ins in instructions.items()}, self.timeout,
                        versions=self._versions(list(instructions)))

    def commit(self, round_idx: int, accepted: Sequence[str]) -> None:
        self.committed.update({c: round_idx for c in accepted})
        self.history.append(dict(self.committed))

    def state_dict(self) -> dict[str, Any]:
        return {"committed": dict(self.committed), "history": [dict(h) for h in self.history]}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        self.committed = {str(c): int(v) for c, v in data.get("committed", {}).items()}
        self.history.clear()
        self.history.extend({str(c): int(v) for c, v in h.items()} for h in data.get("history", []))

    def personalize(self, states: Mapping[str, StateDict]) -> None:
        self._personal = dict(states)

    def finalize(self, state: StateDict, run: RunDir) -> dict[str, dict[str, float]]:
        """Personalize (``train.finalize``) where clients keep a local adapter, then gather the PEFT folders.

        Each client is sent the server's personalised model where the strategy has one (pFedSeq), else ``state``.
        """
        metrics: dict[str, dict[str, float]] = {}
        if self.has_local:
            self._refresh()
            sends = {c: (nid, FitIns(-1, self._personal.get(c, state))) for c, nid in self.nodes.items()}
            for reply in exchange(self.grid, sends, self.timeout, FINALIZE, versions=self._versions(list(sends))):
                if reply.result is None:
                    logger.warning("client %s did not finalize: %s", reply.client_id, reply.error)
                else:
                    metrics[reply.client_id] = dict(reply.result.metrics)
        for cdir in sorted(self.client_dir.iterdir()) if self.client_dir.is_dir() else []:
            final = cdir / FINAL
            local = final / "local.safetensors"
            if local.is_file():
                tensors = load_file(str(local))
                durable.write_folder(run.local_adapter(cdir.name),
                                     functools.partial(write_adapter_folder, config=self.lora, tensors=tensors,
                                                       base_model=self.base_model))
            for index_file in sorted(final.glob("embeddings.*")):  # FedDPA's instance index, beside the adapter
                run.client_dir(cdir.name).mkdir(parents=True, exist_ok=True)
                durable.write_file(run.client_dir(cdir.name) / index_file.name,
                                   functools.partial(shutil.copyfile, index_file))  # copyfile(index_file, tmp)
        return metrics
