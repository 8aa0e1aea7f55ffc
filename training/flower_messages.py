"""The Flower wire format of our protocol: FitIns / FitRes <-> Flower message contents (flwr 1.41).

One message per node per round, each carrying that node's own :class:`~training.protocol.FitIns`
(anchors/federated.md 2.2, "per-client payloads"):

* ``train`` (and ``train.finalize``), server -> node: ``arrays`` (an ``ArrayRecord``, the FitIns
  state), ``config`` (round and the client id the server addresses) and ``fitins`` (the FitIns config);
* reply, node -> server: ``arrays`` (the FitRes state), ``metrics`` (``num-examples`` plus the FitRes
  metrics) and ``config`` (the client id that answered);
* ``query.identify``, server -> node, once per run: the reply names the node's ``partition-id`` and
  the data set client it serves, so the server can address each client's instructions.

The server-side exchanges (:func:`identify_nodes`, :func:`exchange`) live here too.

A ``ConfigRecord`` holds only scalars (int, float, str, bytes, bool) and flat lists of one scalar
type, so any other config value (FedAMoLE's per-module assignment ``{module: [expert ids]}``, empty
lists, tuples) travels as a JSON string under ``json.<key>`` and is decoded on arrival.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from training.protocol import FitIns, FitRes

logger = logging.getLogger(__name__)

JSON_PREFIX = "json."
FINALIZE = f"{MessageType.TRAIN}.finalize"
IDENTIFY = f"{MessageType.QUERY}.identify"
_SCALARS = (bool, int, float, str, bytes)


def _flat(value: Any) -> bool:
    """True when a ConfigRecord carries ``value`` unchanged (a scalar or a non-empty one-type list)."""
    if isinstance(value, _SCALARS):
        return True
    return (isinstance(value, list) and bool(value) and isinstance(value[0], _SCALARS)
            and all(type(v) is type(value[0]) for v in value))


def encode_config(config: Mapping[str, Any]) -> ConfigRecord:
    """A FitIns config as a ``ConfigRecord``; nested values become JSON strings under ``json.<key>``.

    Raises:
        TypeError: a key is not a string, uses the reserved prefix, or a value is not JSON-serialisable
            (tensors belong in the FitIns state, not in its config).
    """
    record: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or key.startswith(JSON_PREFIX):
            raise TypeError(f"FitIns config key {key!r} must be a string not starting with {JSON_PREFIX!r}")
        if _flat(value):
            record[key] = value
            continue
        try:
            record[JSON_PREFIX + key] = json.dumps(value, sort_keys=True)
        except TypeError as exc:
            raise TypeError(f"FitIns config value {key!r} ({type(value).__name__}) cannot cross the network: "
                            f"{exc}; send tensors in FitIns.state") from exc
    return ConfigRecord(record)


def decode_config(record: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_config`."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key.startswith(JSON_PREFIX):
            out[key[len(JSON_PREFIX):]] = json.loads(value)
        else:
            out[key] = list(value) if isinstance(value, list) else value
    return out


def fit_content(ins: FitIns, client_id: str) -> RecordDict:
    """The content of the message that carries ``ins`` to the node serving ``client_id``."""
    return RecordDict({
        "arrays": ArrayRecord(torch_state_dict=dict(ins.state)),
        "config": ConfigRecord({"round": int(ins.round), "client-id": client_id}),
        "fitins": encode_config(ins.config),
    })


def read_fit_content(content: RecordDict) -> tuple[str, FitIns]:
    """(addressed client id, FitIns) from a :func:`fit_content`."""
    meta = content["config"]
    ins = FitIns(round=int(meta["round"]), state=dict(content["arrays"].to_torch_state_dict()),
                 config=decode_config(content["fitins"]))
    return str(meta["client-id"]), ins


def reply_content(res: FitRes) -> RecordDict:
    """A node's answer: what the method uploads, its example count and metrics."""
    return RecordDict({
        "arrays": ArrayRecord(torch_state_dict=dict(res.state)),
        "metrics": MetricRecord({"num-examples": int(res.num_examples),
                                 **{k: float(v) for k, v in res.metrics.items()}}),
        "config": ConfigRecord({"client-id": res.client_id}),
    })


def read_reply_content(content: RecordDict) -> FitRes:
    """The :class:`FitRes` inside a :func:`reply_content`."""
    metrics = dict(content["metrics"])
    num_examples = int(metrics.pop("num-examples"))
    return FitRes(str(content["config"]["client-id"]), dict(content["arrays"].to_torch_state_dict()),
                  num_examples, {k: float(v) for k, v in metrics.items()})


def identity_content(partition: int, client_id: str) -> RecordDict:
    """A node's answer to ``query.identify``: its partition and the data set client it serves."""
    return RecordDict({"config": ConfigRecord({"partition-id": int(partition), "client-id": client_id})})


def read_identity(content: RecordDict) -> tuple[int, str]:
    """(partition id, client id) from an :func:`identity_content`."""
    meta = content["config"]
    return int(meta["partition-id"]), str(meta["client-id"])


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
    grid: Grid, sends: dict[str, tuple[int, FitIns]], timeout: float, message_type: str = MessageType.TRAIN
) -> tuple[list[FitRes], list[tuple[str, str]]]:
    """Send each client its own instructions in one message to its node; collect the replies.

    Args:
        grid: the ServerApp's grid.
        sends: client id -> (node id, that client's FitIns).
        timeout: seconds to wait for the replies.
        message_type: ``train`` (a round) or ``train.finalize``.

    Returns:
        (results, failures), both in the order of ``sends``: failures are (client, reason) for error
        replies, replies from the wrong client and clients that did not answer in time.
    """
    messages = [Message(content=fit_content(ins, cid), dst_node_id=nid, message_type=message_type)
                for cid, (nid, ins) in sends.items()]
    client_of = {nid: cid for cid, (nid, _) in sends.items()}
    results: list[FitRes] = []
    failures: list[tuple[str, str]] = []
    for reply in grid.send_and_receive(messages, timeout=timeout):
        cid = client_of.get(int(reply.metadata.src_node_id), str(reply.metadata.src_node_id))
        if reply.has_error():
            failures.append((cid, str(reply.error.reason)))
            continue
        res = read_reply_content(reply.content)
        if res.client_id != cid:
            failures.append((cid, f"the node answered as client {res.client_id!r}"))
            continue
        results.append(res)
    answered = {r.client_id for r in results} | {c for c, _ in failures}
    failures += [(c, f"no reply within {timeout} s") for c in sends if c not in answered]
    rank = {c: i for i, c in enumerate(sends)}  # replies come as nodes finish: back to the selection order
    return (sorted(results, key=lambda r: rank[r.client_id]),
            sorted(failures, key=lambda f: rank.get(f[0], len(rank))))
