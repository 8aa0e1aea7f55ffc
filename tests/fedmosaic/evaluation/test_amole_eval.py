"""``fedmosaic eval`` on a FedAMoLE run: each client's own model by default (paper 002 App. D.1.1),
the aggregated pool with ``--amole-model aggregated``, the two never sharing cached answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters import LoraConfig, inject
from adapters.amole_io import save_amole
from adapters.amole_layer import add_amole_experts
from adapters.rundir import RunDir
from fedmosaic.cli import main
from fedmosaic.evaluation.evaluate import EvalOptions, evaluate_run
from fedmosaic.evaluation.inputs import EvalSetupError
from models import save_tiny_llama, tiny_llama

DATA = {"n_train": 4, "n_test": 3, "families": ["sorting", "capitals"]}
CLIENTS = ("sorting", "capitals")


def save_pool(folder: Path, seed: int, clients: tuple[str, ...]) -> None:
    """An AMoLE folder for the tiny model: random experts, each client on two of four experts per layer."""
    adapted = inject(tiny_llama().model)
    add_amole_experts(adapted, 4, LoraConfig(r=4, alpha=8.0, dropout=0.0), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for layer in adapted.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen))
    ids = {"sorting": [0, 1], "capitals": [2, 3]}
    save_amole(adapted, folder, 4, {c: {p: ids[c] for p in adapted.layers} for c in clients}, top_k=1)


def build(root: Path, own: tuple[str, ...]) -> RunDir:
    run = RunDir(root / "run")
    save_pool(run.amole, 0, CLIENTS)
    for i, client in enumerate(own):  # export=local: each client's own model beside the aggregated pool
        save_pool(run.client_dir(client) / "amole", 1 + i, (client,))
    run.run_json.write_text(json.dumps({"method": "fedamole", "data": "generated", "data_options": DATA,
                                        "model": str(save_tiny_llama(root / "model"))}))
    return run


def rows(run: RunDir, client: str) -> list[dict]:
    path = run.eval_dir / "predictions" / "final" / client / "capitals.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_scores_each_clients_own_model_and_the_pool_on_request(tmp_path: Path) -> None:
    run = build(tmp_path, own=CLIENTS)
    local = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32"))
    assert local["amole_model"] == "local"
    for client in CLIENTS:
        assert local["targets"][client]["target"] == client
        assert local["targets"][client]["amole_model"] == f"{client}:amole"
    assert [r["route"]["model"] for r in rows(run, "sorting")] == ["sorting:amole"]  # decoded by its own bundle

    pooled = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32", amole_model="aggregated"))
    assert pooled["amole_model"] == "aggregated"
    for client in CLIENTS:
        assert pooled["targets"][client]["target"] == f"amole:{client}"
        assert pooled["targets"][client]["amole_model"] == "amole"
    both = rows(run, "sorting")  # the pool's answer was generated, not taken from the local model's row
    assert [r["route"]["model"] for r in both] == ["sorting:amole", "amole"] and both[0]["tag"] != both[1]["tag"]

    again = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32"))  # cached: no new rows
    assert len(rows(run, "sorting")) == 2 and again["scores"] == local["scores"]
    code = main(["eval", str(run.root), "--limit", "1", "--max-new-tokens", "2", "--dtype", "float32",
                 "--amole-model", "aggregated"])
    summary = json.loads((run.eval_dir / "results.json").read_text())
    assert code == 0 and summary["amole_model"] == "aggregated" and len(rows(run, "sorting")) == 2


def test_a_run_without_own_models_is_scored_on_its_pool(tmp_path: Path) -> None:
    run = build(tmp_path, own=())
    with pytest.raises(EvalSetupError, match="--amole-model aggregated"):  # before any model is loaded
        evaluate_run(run.root, EvalOptions(limit=1, amole_model="local"))
    summary = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32"))
    assert summary["amole_model"] == "aggregated"
    target = summary["targets"]["sorting"]
    assert target["target"] == "sorting" and target["amole_model"] == "amole"  # the pool, under the client's name


def test_a_client_the_last_round_left_out_is_scored_on_the_pool_and_said_so(tmp_path: Path) -> None:
    run = build(tmp_path, own=("sorting",))
    with pytest.warns(UserWarning, match=r"\['capitals'\] have no own model"):
        summary = evaluate_run(run.root, EvalOptions(limit=1, max_new_tokens=2, dtype="float32"))
    assert summary["amole_model"] == "local" and summary["targets"]["sorting"]["amole_model"] == "sorting:amole"
    assert summary["targets"]["capitals"]["target"] == "amole:capitals"
