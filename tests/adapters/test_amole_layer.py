"""AMoLE routing inside the injected model: per-client groups, reduction cases, stats, gradients."""

from __future__ import annotations

import pytest
import torch

from adapters import AdapterError, LoraConfig, inject
from adapters.amole import amole_forward
from adapters.amole_layer import SHARED, add_amole_experts, amole_parameters, expert_name, token_proj_state
from adapters.context import AMoLERouting
from fedmosaic.models import LoadedModel

IDS = torch.tensor([[5, 17, 33, 8], [9, 10, 11, 12], [3, 4, 5, 6]])


@pytest.fixture()
def amole(tiny: LoadedModel):  # noqa: ANN201
    adapted = inject(tiny.model)
    add_amole_experts(adapted, num_experts=5, config=LoraConfig(r=4, dropout=0.0), seed=0)
    gen = torch.Generator().manual_seed(1)
    for layer in adapted.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * 0.2)
    return adapted


def assignment(adapted, ids):  # noqa: ANN001, ANN201
    return {path: tuple(ids) for path in adapted.layers}


def run(adapted, groups, row_group, **kw):  # noqa: ANN001, ANN003, ANN201
    routing = AMoLERouting(groups=tuple(groups), row_group=torch.tensor(row_group), **kw)
    with torch.no_grad(), adapted.context.route_amole(routing):
        return adapted.model(IDS).logits


def test_mixed_clients_equal_separate_runs(amole) -> None:  # noqa: ANN001
    a, b = assignment(amole, (0, 2, 3)), assignment(amole, (1, 4))
    mixed = run(amole, [a, b], [0, 1, 0])
    alone_a = run(amole, [a], [0, 0, 0])
    alone_b = run(amole, [b], [0, 0, 0])
    torch.testing.assert_close(mixed[0], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[2], alone_a[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], alone_b[1], atol=1e-5, rtol=1e-5)


def test_one_expert_reduces_to_shared_plus_that_expert(amole) -> None:  # noqa: ANN001
    got = run(amole, [assignment(amole, (3,))], [0, 0, 0])
    with torch.no_grad(), amole.context.use((SHARED, expert_name(3)), torch.ones(3, 2)):
        want = amole.model(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_layer_matches_the_pure_function(amole) -> None:  # noqa: ANN001
    path, layer = next(iter(amole.layers.items()))
    x = torch.randn(2, 3, layer.in_features)
    routing = AMoLERouting(groups=({path: (0, 1, 4)},), row_group=torch.tensor([0, 0]))
    with torch.no_grad(), amole.context.route_amole(routing):
        got = layer(x)
    ex = [layer.adapters[expert_name(j)] for j in (0, 1, 4)]
    sh = layer.adapters[SHARED]
    want = amole_forward(x, layer.base_layer(x), sh.lora_A, sh.lora_B, torch.stack([e.lora_A for e in ex]),
                         torch.stack([e.lora_B for e in ex]), layer.token_proj, ex[0].scaling, 2).out
    torch.testing.assert_close(got, want.detach())


def test_stats_and_gradients_for_training(amole) -> None:  # noqa: ANN001
    amole.model.train()
    routing = AMoLERouting(groups=(assignment(amole, (0, 1, 2)),), row_group=torch.tensor([0, 0, 0]))
    with amole.context.route_amole(routing):
        loss = amole.model(IDS, labels=IDS).loss
    loss.backward()
    assert len(routing.stats) == len(amole.layers)
    params = amole_parameters(amole, assignment(amole, (0, 1, 2)))
    assert all(p.grad is not None for p in params)
    held = amole.layers[next(iter(amole.layers))].adapters[expert_name(3)].lora_B
    assert held.grad is None  # an expert the client does not hold gets nothing
    assert len(token_proj_state(amole)) == len(amole.layers)


def test_routing_errors(amole) -> None:  # noqa: ANN001
    with pytest.raises(AdapterError, match="no expert assignment"):
        run(amole, [{}], [0, 0, 0])
    with pytest.raises(AdapterError, match="no domain experts"):
        run(amole, [assignment(amole, (0, 9))], [0, 0, 0])
    with pytest.raises(AdapterError, match="index the 1 assignment groups"):
        AMoLERouting(groups=({},), row_group=torch.tensor([0, 1]))


def test_save_and_load_round_trip(amole, tiny: LoadedModel, tmp_path) -> None:  # noqa: ANN001
    from adapters.amole_io import load_amole, save_amole
    from fedmosaic.tiny import tiny_llama

    groups = {"c0": assignment(amole, (0, 2)), "c1": assignment(amole, (1, 3, 4))}
    save_amole(amole, tmp_path / "am", num_experts=5, assignments=groups)
    before = run(amole, [groups["c0"], groups["c1"]], [0, 1, 1])
    fresh = inject(tiny_llama().model)
    loaded, top_k = load_amole(fresh, tmp_path / "am")
    assert top_k == 2 and loaded["c1"] == groups["c1"]
    after = run(fresh, [loaded["c0"], loaded["c1"]], [0, 1, 1])
    torch.testing.assert_close(after, before)
    with pytest.raises(AdapterError, match="already holds AMoLE experts"):
        load_amole(fresh, tmp_path / "am")
