"""A Flower node's private state by version: memory first, the durable mirror after a restart, damaged or
pruned versions refused by name, the personalization written whole into ``final/``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from safetensors.torch import load_file

from training.flower.node_state import FINAL, PrivateStore


def _context() -> Context:
    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


def _local(x: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"local": {"m.lora_A": torch.full((2, 3), x, dtype=torch.bfloat16)}}


def test_each_version_reads_back_from_memory_or_after_a_restart_from_the_mirror(tmp_path: Path) -> None:
    store = PrivateStore(_context(), tmp_path / "c")
    assert store.load(-1) == {}
    store.save(1, _local(1.0))
    store.save(2, _local(2.0))
    assert torch.equal(store.load(2)["local"]["m.lora_A"], _local(2.0)["local"]["m.lora_A"])  # memory
    restarted = PrivateStore(_context(), tmp_path / "c")  # a new SuperNode process or a new run: empty memory
    back = restarted.load(1)["local"]["m.lora_A"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, _local(1.0)["local"]["m.lora_A"])
    assert restarted.versions() == [1, 2]


def test_a_damaged_or_pruned_version_is_refused_by_name(tmp_path: Path) -> None:
    store = PrivateStore(_context(), tmp_path / "c")
    for v in range(3):
        store.save(v, _local(float(v)))
    assert store.prune(2) == [0, 1] and store.versions() == [2]
    fresh = PrivateStore(_context(), tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="version 1 is not in"):
        fresh.load(1)
    f = tmp_path / "c" / "v2" / "local.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    f.write_bytes(bytes(data))
    with pytest.raises(FileNotFoundError, match="version 2 .* is damaged"):
        fresh.load(2)


def test_the_personalization_is_written_whole(tmp_path: Path) -> None:
    store = PrivateStore(_context(), tmp_path / "c")

    def build(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
        (folder / "embeddings.npy").write_bytes(b"index")
        return _local(3.0)

    store.save_final(build)
    final = tmp_path / "c" / FINAL
    assert (final / "embeddings.npy").read_bytes() == b"index"
    assert torch.equal(load_file(str(final / "local.safetensors"))["m.lora_A"], _local(3.0)["local"]["m.lora_A"])

    def fail(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
        (folder / "embeddings.npy").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        store.save_final(fail)
    assert (final / "embeddings.npy").read_bytes() == b"index"  # the earlier result, untouched
