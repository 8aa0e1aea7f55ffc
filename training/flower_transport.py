"""The Flower bridge's server side: the round loop's transport over a ServerApp's Grid (flwr 1.41).

:mod:`training.rounds` runs the loop in the ServerApp; this transport moves its messages ("write the
loop yourself", anchors/federated.md 2.2):

1. once per run, a ``query.identify`` message to every node: each answers with its ``partition-id``
   and the data set client it serves, giving the node -> client map (:func:`identify_nodes`);
2. each round, one ``train`` message per selected client to its node, carrying ITS instructions (the
   wire format is :mod:`training.flower_messages`), all sent and collected with the Grid's
   ``send_and_receive``; an error reply, a reply from the wrong client or none within the timeout is
   that client's failure for the round (:func:`exchange`);
3. at the end, a ``train.finalize`` message for methods with a local adapter (each node personalizes
   and, for FedDPA, embeds its own instances), then the local adapters and indexes are gathered from
   the nodes' disk mirror of their private state into the run directory.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid
from safetensors.torch import load_file

from adapters import LoraConfig, write_adapter_folder
from adapters.rundir import RunDir
from training.flower_messages import FINALIZE, IDENTIFY, fit_content, read_identity, read_reply_content
from training.protocol import FitIns, StateDict
from training.rounds import Reply, Transport

logger = logging.getLogger(__name__)


def identify_nodes(grid: Grid, timeout: float) -> dict[str, int]:
    """client id -> node id, from one ``query.identify`` exchange with every connected node.

    Waits up to ``timeout`` for a first node to connect; a node that answers with an error is logged
    and left out.

    Raises:
        ValueError: two nodes serve the same client (two SuperNodes with one ``partition-id``).
        RuntimeError: no node identified itself.
    """
    deadline = time.monotonic() + timeout
    while not (ids := sorted(grid.get_node_ids())) and time.monotonic() < deadline:
        time.sleep(1.0)  # a deployment's SuperNodes may still be connecting
    asked = [Message(content=RecordDict(), dst_node_id=nid, message_type=IDENTIFY) for nid in ids]
    nodes: dict[str, int] = {}
    for reply in grid.send_and_receive(asked, timeout=timeout):
        src = int(reply.metadata.src_node_id)
        if reply.has_error():
            logger.warning("node %d did not identify itself: %s", src, reply.error.reason)
            continue
        partition, cid = read_identity(reply.content)
        if cid in nodes:
            raise ValueError(f"nodes {nodes[cid]} and {src} both serve client {cid!r} (partition-id {partition})")
        nodes[cid] = src
    if not nodes:
        raise RuntimeError(f"none of the {len(asked)} connected nodes identified itself")
    return nodes


def exchange(
    grid: Grid, sends: Mapping[str, tuple[int, FitIns]], timeout: float, message_type: str = MessageType.TRAIN
) -> list[Reply]:
    """Send each client its own instructions in one message to its node; collect the replies.

    Args:
        grid: the ServerApp's grid.
        sends: client id -> (node id, that client's FitIns).
        timeout: seconds to wait for the replies.
        message_type: ``train`` (a round) or ``train.finalize``.

    Returns:
        One reply per client of ``sends``, in its order: the result, or the reason there is none (an
        error reply, a reply from the wrong client, no reply in time).
    """
    messages = [Message(content=fit_content(ins, cid), dst_node_id=nid, message_type=message_type)
                for cid, (nid, ins) in sends.items()]
    client_of = {nid: cid for cid, (nid, _) in sends.items()}
    got: dict[str, Reply] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        cid = client_of.get(int(reply.metadata.src_node_id), str(reply.metadata.src_node_id))
        if reply.has_error():
            got[cid] = Reply(cid, error=str(reply.error.reason))
            continue
        res = read_reply_content(reply.content)
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
        timeout: seconds to wait for the replies of one exchange.
        has_local: the method's clients end with a local adapter (they get a ``train.finalize``).
        client_dir: where the nodes mirror their private state (``<client>/local.safetensors``, indexes).
        lora: the LoRA config of the local PEFT folders.
        base_model: the base model name recorded in them.
    """

    def __init__(self, grid: Grid, timeout: float, has_local: bool, client_dir: Path, lora: LoraConfig,
                 base_model: str) -> None:
        self.grid, self.timeout, self.has_local, self.client_dir = grid, timeout, has_local, client_dir
        self.lora, self.base_model = lora, base_model
        self._nodes: dict[str, int] | None = None
        self._personal: dict[str, StateDict] = {}  # the server's personalised model per client (pFedSeq)

    @property
    def nodes(self) -> dict[str, int]:
        """client id -> node id, identified at the first use."""
        if self._nodes is None:
            self._nodes = identify_nodes(self.grid, self.timeout)
        return self._nodes

    def reachable(self, clients: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        present = [c for c in clients if c in self.nodes]
        return present, [(c, "no connected node serves this client") for c in clients if c not in self.nodes]

    def fit(self, round_idx: int, instructions: Mapping[str, FitIns]) -> list[Reply]:
        return exchange(self.grid, {c: (self.nodes[c], ins) for c, ins in instructions.items()}, self.timeout)

    def personalize(self, states: Mapping[str, StateDict]) -> None:
        self._personal = dict(states)

    def finalize(self, state: StateDict, run: RunDir) -> None:
        """Personalize (``train.finalize``) where clients keep a local adapter, then gather the PEFT folders.

        Each client is sent the server's personalised model where the strategy has one (pFedSeq), else ``state``.
        """
        if self.has_local:
            sends = {c: (nid, FitIns(-1, self._personal.get(c, state))) for c, nid in self.nodes.items()}
            for reply in exchange(self.grid, sends, self.timeout, FINALIZE):
                if reply.result is None:
                    logger.warning("client %s did not finalize: %s", reply.client_id, reply.error)
        for cdir in sorted(self.client_dir.iterdir()) if self.client_dir.is_dir() else []:
            local = cdir / "local.safetensors"
            if local.is_file():
                write_adapter_folder(run.local_adapter(cdir.name), self.lora, load_file(str(local)), self.base_model)
            for index_file in sorted(cdir.glob("embeddings.*")):  # FedDPA's instance index, beside the adapter
                run.client_dir(cdir.name).mkdir(parents=True, exist_ok=True)
                shutil.copy2(index_file, run.client_dir(cdir.name) / index_file.name)
