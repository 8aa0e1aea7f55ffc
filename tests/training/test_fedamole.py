"""FedAMoLE end to end on the tiny model: assignments, what travels, aggregation over holders, export."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adapters import inject
from adapters.amole_io import load_amole
from adapters.rundir import RunDir
from fedmosaic.tiny import tiny_llama
from training.algorithms.fedamole import EMB, FedAMoLEStrategy
from training.data import generate_suite
from training.protocol import FitRes
from training.rsea import AMoLEConfig
from training.runtime import preset
from training.simulation import SimConfig, run_federated

DATA = generate_suite(n_train=6, n_test=2, families=["sorting", "capitals", "arithmetic", "sentiment"])
OPTS = {"num_experts": 4, "max_experts": 3, "expert_choices": 2}


def test_two_rounds_assign_train_and_export(tmp_path: Path) -> None:
    summary = run_federated("fedamole", DATA, tiny_llama(), tmp_path / "am", SimConfig(rounds=2), preset("tiny"),
                            OPTS, data_spec="generated")
    assert summary.failures == [] and all(x == x for x in summary.losses)
    run = RunDir(tmp_path / "am")
    for r in (0, 1):
        assignment = json.loads((run.round_dir(r) / "strategy.json").read_text())["assignment"]
        for clients in assignment.values():
            counts = [sum(j in ids for ids in clients.values()) for j in range(4)]
            assert counts == [2, 2, 2, 2]  # every expert reverse-selects exactly k_c = 2 clients
            assert all(2 <= len(ids) <= 3 for ids in clients.values())
    rows = [json.loads(x) for x in run.metrics.read_text().splitlines() if '"status": "ok"' in x]
    assert all(0 < x["bytes_up"] and 0 < x["bytes_down"] for x in rows) and all("load_balance" in x for x in rows)
    adapted = inject(tiny_llama().model)
    assignments, top_k = load_amole(adapted, run.amole)
    assert top_k == 2 and set(assignments) == set(DATA.client_ids)


def test_aggregation_averages_each_expert_only_over_its_holders() -> None:
    strategy = FedAMoLEStrategy(AMoLEConfig(num_experts=3, max_experts=3, min_experts=1, expert_choices=1))
    key = "m.expert_{}.lora_A"
    state = {key.format(j): torch.full((1,), 10.0 * j) for j in range(3)} | {"m.token_proj": torch.zeros(1)}
    up_a = {key.format(0): torch.tensor([1.0]), "m.token_proj": torch.tensor([2.0]),
            f"{EMB}m.client": torch.ones(2), f"{EMB}m.expert_0": torch.ones(2)}
    up_b = {key.format(0): torch.tensor([3.0]), key.format(1): torch.tensor([5.0]), "m.token_proj": torch.tensor([4.0]),
            f"{EMB}m.client": torch.ones(2), f"{EMB}m.expert_0": torch.ones(2), f"{EMB}m.expert_1": torch.ones(2)}
    new = strategy.aggregate(1, [FitRes("a", up_a, 1), FitRes("b", up_b, 100)], [], state)
    assert new is not None
    assert float(new[key.format(0)]) == 2.0  # both held expert 0: plain mean, no size weighting
    assert float(new[key.format(1)]) == 5.0  # only b held expert 1
    assert float(new[key.format(2)]) == 20.0  # nobody held expert 2: unchanged
    assert float(new["m.token_proj"]) == 3.0  # projections over all clients
    assert not any(k.startswith(EMB) for k in new)  # embeddings inform the assignment, never the model
    assert strategy.scores is not None and len(strategy.scores["m"]) == 3
