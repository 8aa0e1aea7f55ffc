"""The Flower wire format of our protocol: FitIns / FitRes <-> Flower message contents (flwr 1.41).

One message per node per round, each carrying that node's own :class:`~training.protocol.FitIns`
(anchors/federated.md 2.2, "per-client payloads"):

* ``train`` (and ``train.finalize``), server -> node: ``arrays`` (an ``ArrayRecord``, the FitIns
  state), ``config`` (round, the client id the server addresses, and the private-state versions:
  ``private-from``, the one to start from, and ``private-keep``, the oldest a resume point may still
  ask for; see :mod:`training.flower.node_state`) and ``fitins`` (the FitIns config);
* reply, node -> server: ``arrays`` (the FitRes state), ``metrics`` (``num-examples`` plus the FitRes
  metrics) and ``config`` (the client id that answered);
* ``query.identify``, server -> node, once per run: the reply names the node's ``partition-id`` and
  the data set client it serves, so the server can address each client's instructions.

The server side of the exchanges is :mod:`training.flower.transport`.

A ``ConfigRecord`` holds only scalars (int, float, str, bytes, bool) and flat lists of one scalar
type, so any other config value (FedAMoLE's per-module assignment ``{module: [expert ids]}``, empty
lists, tuples) travels as a JSON string under ``json.<key>`` and is decoded on arrival.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, ConfigRecordValues, ConfigScalar, MessageType, MetricRecord, RecordDict

from training.protocol import FitIns, FitRes

JSON_PREFIX = "json."
FINALIZE = f"{MessageType.TRAIN}.finalize"
IDENTIFY = f"{MessageType.QUERY}.identify"
_SCALARS = (bool, int, float, str, bytes)
R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)


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


def _record(content: RecordDict, key: str, kind: type[R]) -> R:
    """``content[key]``, the ``kind`` record this module's contents hold there (TypeError: another kind)."""
    record = content[key]
    if not isinstance(record, kind):
        raise TypeError(f"message record {key!r} is a {type(record).__name__}, expected a {kind.__name__}")
    return record


def _scalar(value: ConfigRecordValues) -> ConfigScalar:
    """A record value this module writes as one scalar (TypeError, as int() or float() raise, for a list)."""
    if isinstance(value, list):
        raise TypeError(f"expected one value, got the list {value!r}")
    return value


def fit_content(ins: FitIns, client_id: str, private_from: int = -1, private_keep: int = -1) -> RecordDict:
    """The content of the message that carries ``ins`` to the node serving ``client_id``.

    Args:
        ins: the client's instructions.
        client_id: the client addressed.
        private_from: the private-state version the node must start from (-1: none yet).
        private_keep: the oldest version the node must keep (-1: all).
    """
    return RecordDict({
        "arrays": ArrayRecord(torch_state_dict=dict(ins.state)),
        "config": ConfigRecord({"round": int(ins.round), "client-id": client_id,
                                "private-from": int(private_from), "private-keep": int(private_keep)}),
        "fitins": encode_config(ins.config),
    })


def read_private_versions(content: RecordDict) -> tuple[int, int]:
    """(``private-from``, ``private-keep``) of a :func:`fit_content`."""
    meta = _record(content, "config", ConfigRecord)
    return int(_scalar(meta.get("private-from", -1))), int(_scalar(meta.get("private-keep", -1)))


def read_fit_content(content: RecordDict) -> tuple[str, FitIns]:
    """(addressed client id, FitIns) from a :func:`fit_content`."""
    meta = _record(content, "config", ConfigRecord)
    ins = FitIns(round=int(_scalar(meta["round"])),
                 state=dict(_record(content, "arrays", ArrayRecord).to_torch_state_dict()),
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
    metrics = dict(_record(content, "metrics", MetricRecord))
    num_examples = int(_scalar(metrics.pop("num-examples")))
    return FitRes(str(content["config"]["client-id"]),
                  dict(_record(content, "arrays", ArrayRecord).to_torch_state_dict()),
                  num_examples, {k: float(_scalar(v)) for k, v in metrics.items()})


def identity_content(partition: int, client_id: str) -> RecordDict:
    """A node's answer to ``query.identify``: its partition and the data set client it serves."""
    return RecordDict({"config": ConfigRecord({"partition-id": int(partition), "client-id": client_id})})


def read_identity(content: RecordDict) -> tuple[int, str]:
    """(partition id, client id) from an :func:`identity_content`."""
    meta = _record(content, "config", ConfigRecord)
    return int(_scalar(meta["partition-id"])), str(meta["client-id"])
