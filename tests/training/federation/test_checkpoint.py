"""Round checkpoints: strategy tensors round-trip bit-exactly through strategy.safetensors, JSON-only state is
written as before, and a round whose files are missing or cut short is not a resume point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import training.federation.durable as durable
from adapters import LoraConfig
from adapters.rundir import RunDir
from training.federation.checkpoint import (
    COMPLETE,
    join_tensors,
    last_complete,
    load_round,
    prune_strategy_state,
    save_round,
    split_tensors,
)

SERVER = {"layers.0.lora_A": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def _save(run: RunDir, r: int, strategy: dict[str, Any], private: dict | None = None) -> Path:
    return save_round(run, r, SERVER, strategy, private or {}, LoraConfig(), "tiny", peft_global=False)


def _nested() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(4, 6, generator=g)
    return {
        "version": 2, "name": "x", "ratio": 0.25, "flag": True, "none": None, "empty": {}, "no_items": [],
        "history": [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(3, 5, generator=g)],
        "learners": {"0.stack.A_log": torch.randn(2, 2, generator=g, dtype=torch.float64),
                     "odd/key~name": torch.arange(5, dtype=torch.int64) - 2**40},
        "adam": {"state": {"0": {"step": torch.tensor(3.0), "exp_avg": big[:, 1:3]}},  # a strided view
                 "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "params": [0, 1]}]},
        "mixed": [1, "two", [torch.zeros(0, 3), {"deep": big[1:], "tied": big}]],  # overlaps: needs a copy
        "calib": torch.full((2, 3), float("nan")),
    }


def _same(a: Any, b: Any) -> bool:
    """Equal structure and bit-identical tensors (same dtype and shape; NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_nested_tensors_round_trip_bit_exactly(tmp_path: Path) -> None:
    run, state = RunDir(tmp_path), _nested()
    folder = _save(run, 0, state)
    skeleton = json.loads((folder / "strategy.json").read_text())
    assert skeleton["history"][0] == {"__tensor__": "history/0"}
    assert skeleton["learners"]["odd/key~name"] == {"__tensor__": "learners/odd~1key~0name"}  # RFC 6901 escapes
    assert skeleton["mixed"][:2] == [1, "two"] and skeleton["empty"] == {} and skeleton["no_items"] == []
    stored = load_file(str(folder / "strategy.safetensors"))
    assert stored["history/0"].dtype == torch.bfloat16 and stored["learners/odd~1key~0name"].dtype == torch.int64
    server, loaded, private = load_round(run, 0)
    assert _same(state, loaded) and torch.equal(server["layers.0.lora_A"], SERVER["layers.0.lora_A"])
    assert private == {} and last_complete(run) == 0


def test_split_and_join_are_inverse_and_reject_the_reserved_key() -> None:
    state = _nested()
    skeleton, tensors = split_tensors(state)
    assert json.loads(json.dumps(skeleton)) == skeleton and len(tensors) == 10
    assert _same(state, join_tensors(skeleton, tensors))
    assert split_tensors({}) == ({}, {})
    with pytest.raises(ValueError, match="reserved key '__tensor__'"):
        split_tensors({"a": [{"__tensor__": "history/0"}]})
    with pytest.raises(ValueError, match="map to the tensor key .1."):
        split_tensors({1: torch.ones(1), "1": torch.zeros(1)})
    with pytest.raises(KeyError, match="'calib', missing from strategy.safetensors"):
        join_tensors({"c": {"__tensor__": "calib"}}, {})


@pytest.mark.parametrize("strategy", [
    {},
    {"assignment": {"a": [0, 2], "b": [1]}, "scores": [[0.5, float("nan")], [1e-30, -2.0]], "score_clients": None},
    {"version": 1, "nested": {"0": [], "k": {"x": (1, 2)}}, 3: "int key"},
])
def test_json_only_state_is_written_exactly_as_before(tmp_path: Path, strategy: dict[Any, Any]) -> None:
    run = RunDir(tmp_path)
    folder = _save(run, 0, strategy)
    assert (folder / "strategy.json").read_text() == json.dumps(strategy)  # the pre-safetensors format
    assert not (folder / "strategy.safetensors").exists()
    _, loaded, _ = load_round(run, 0)
    assert json.dumps(loaded) == json.dumps(strategy) and last_complete(run) == 0


def test_private_states_and_rounds_round_trip(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    private = {"c1": {"local": {"w": torch.ones(2, dtype=torch.bfloat16)}}}
    _save(run, 0, {"k": torch.zeros(1)}, private)
    _save(run, 1, {"k": torch.ones(1)}, private)
    _, strategy, back = load_round(run, 1)
    assert torch.equal(strategy["k"], torch.ones(1)) and back["c1"]["local"]["w"].dtype == torch.bfloat16
    assert last_complete(run) == 1


@pytest.mark.parametrize("damage", ["missing", "truncated", "header_only", "lacks_key"])
def test_a_round_with_a_missing_or_partial_strategy_safetensors_is_not_complete(tmp_path: Path, damage: str) -> None:
    run = RunDir(tmp_path)
    _save(run, 0, _nested())
    folder = _save(run, 1, _nested())
    path = folder / "strategy.safetensors"
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[:-7])
    elif damage == "header_only":
        path.write_bytes(data[:20])
    else:
        skeleton = json.loads((folder / "strategy.json").read_text())
        skeleton["extra"] = {"__tensor__": "not/written"}
        (folder / "strategy.json").write_text(json.dumps(skeleton))
    assert (folder / COMPLETE).is_file() and last_complete(run) == 0  # falls back to the intact round
    with pytest.raises(FileNotFoundError, match="round 1 has no complete checkpoint.*strategy"):
        load_round(run, 1)


def test_a_crash_while_writing_strategy_tensors_leaves_no_complete_round(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path)
    _save(run, 0, {"k": torch.zeros(3)})
    real = durable.save_file

    def crash_on_strategy(tensors: dict[str, torch.Tensor], filename: str, metadata: object = None) -> None:
        if "k" in tensors:  # the strategy's file: write part of it, then die
            real(tensors, filename)
            Path(filename).write_bytes(Path(filename).read_bytes()[:30])
            raise OSError("disk full")
        real(tensors, filename)

    monkeypatch.setattr(durable, "save_file", crash_on_strategy)
    with pytest.raises(OSError, match="disk full"):
        _save(run, 1, {"k": torch.ones(3)})
    folder = run.round_dir(1)
    assert not (folder / COMPLETE).exists() and not (folder / "strategy.safetensors").exists()
    assert not list(folder.glob(".tmp-*"))  # the partial temporary file is removed
    assert last_complete(run) == 0
    monkeypatch.setattr(durable, "save_file", real)
    _save(run, 1, {"k": torch.ones(3)})  # a retry replaces the failed attempt
    assert last_complete(run) == 1 and torch.equal(load_round(run, 1)[1]["k"], torch.ones(3))


def test_pruning_keeps_the_strategy_tensors_of_the_newest_complete_rounds_only(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for r in range(4):
        _save(run, r, {"k": torch.full((3,), float(r))}, {"c": {"local": SERVER}})
    (run.round_dir(3) / COMPLETE).unlink()  # an interrupted round never counts as one of the newest
    assert prune_strategy_state(run, 0) == [] and prune_strategy_state(run, 2) == [0]
    assert prune_strategy_state(run, 2) == []  # idempotent
    assert last_complete(run) == 2 and torch.equal(load_round(run, 1)[1]["k"], torch.ones(3))
    with pytest.raises(FileNotFoundError, match="round 0 .*pruned"):
        load_round(run, 0)
    kept = run.round_dir(0)  # what evaluation and analysis read stays
    assert (kept / "server.safetensors").is_file() and (kept / "clients" / "c" / "local.safetensors").is_file()
    assert json.loads((kept / "strategy.json").read_text()) == {"k": {"__tensor__": "k"}}
    assert prune_strategy_state(run, 1) == [1] and last_complete(run) == 2
    with pytest.raises(ValueError, match="keep_strategy must be >= 0"):
        prune_strategy_state(run, -1)
