"""AMoLE routing inside the injected model: per-client groups, reduction cases, stats, gradients, the
expert-choice recorder, rows outside AMoLE in the same batch, prefixed expert sources (served versions)."""

from __future__ import annotations

import pytest
import torch

from adapters import AdapterError, LoraConfig, inject
from adapters.amole import amole_forward
from adapters.amole_layer import SHARED, add_amole_experts, amole_parameters, expert_name, token_proj_state
from adapters.amole_routing import AMoLEExperts, AMoLERouting
from adapters.amole_union import ExpertRecorder
from models import LoadedModel

IDS = torch.tensor([[5, 17, 33, 8], [9, 10, 11, 12], [3, 4, 5, 6]])


def _experts(tiny: LoadedModel, router: str = "amole"):  # noqa: ANN202
    """5 experts per layer with seeded non-zero B (so each expert changes the output)."""
    adapted = inject(tiny.model)
    add_amole_experts(adapted, num_experts=5, config=LoraConfig(r=4, dropout=0.0), seed=0, router=router)
    gen = torch.Generator().manual_seed(1)
    for layer in adapted.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * 0.2)
    return adapted


@pytest.fixture()
def amole(tiny: LoadedModel):  # noqa: ANN201
    return _experts(tiny)


def assignment(adapted, ids):  # noqa: ANN001, ANN201
    return {path: tuple(ids) for path in adapted.layers}


def run(adapted, groups, row_group, **kw):  # noqa: ANN001, ANN003, ANN201
    routing = AMoLERouting(groups=tuple(groups), row_group=torch.tensor(row_group), **kw)
    with torch.no_grad(), adapted.context.route_tokens(routing):
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
    with torch.no_grad(), amole.context.route_tokens(routing):
        got = layer(x)
    ex = [layer.adapters[expert_name(j)] for j in (0, 1, 4)]
    sh = layer.adapters[SHARED]
    want = amole_forward(x, layer.base_layer(x), sh.lora_A, sh.lora_B, torch.stack([e.lora_A for e in ex]),
                         torch.stack([e.lora_B for e in ex]), layer.token_proj, ex[0].scaling, 2).out
    torch.testing.assert_close(got, want.detach())


def test_stats_and_gradients_for_training(amole) -> None:  # noqa: ANN001
    amole.model.train()
    routing = AMoLERouting(groups=(assignment(amole, (0, 1, 2)),), row_group=torch.tensor([0, 0, 0]))
    with amole.context.route_tokens(routing):
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
    from models import tiny_llama

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


def per_layer_assignment(adapted, client: int):  # noqa: ANN001, ANN201
    """A different expert set in every layer (a client's assignment differs per module)."""
    return {path: tuple(sorted({(client + i) % 5, (client + 2 * i + 1) % 5, (3 * client + i + 2) % 5}))
            for i, path in enumerate(adapted.layers)}


def test_recorded_choices_equal_a_naive_gate(amole) -> None:  # noqa: ANN001
    groups = [per_layer_assignment(amole, 0), per_layer_assignment(amole, 1)]
    inputs: dict[str, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, p=path: inputs.__setitem__(p, args[0].detach()))
             for path, layer in amole.layers.items()]
    recorder = ExpertRecorder()
    try:
        run(amole, groups, [0, 1, -1], recorder=recorder)
    finally:
        for h in hooks:
            h.remove()
    for path, layer in amole.layers.items():
        P = layer.token_proj.detach()
        for row, g in ((0, 0), (1, 1)):
            ids = groups[g][path]
            chosen = recorder.choices(path, row)  # (T, k)
            assert chosen.shape == (IDS.shape[1], 2)
            for t in range(IDS.shape[1]):
                h = inputs[path][row, t]  # (d,)
                token = P @ h
                scores = [float(layer.adapters[expert_name(j)].lora_A.detach() @ h @ token) / 4 ** 0.5 for j in ids]
                gate = torch.tensor(scores).softmax(0)
                naive = {ids[i] for i in gate.topk(2).indices.tolist()}
                assert set(chosen[t].tolist()) == naive
        assert all((rows != 2).all() for p, rows, *_ in recorder.records if p == path)  # the -1 row is not routed
    counts = recorder.counts(list(amole.layers), 5, 3)
    assert counts.shape == (3, len(amole.layers), 5)
    assert (counts[:2].sum(-1) == 2 * IDS.shape[1]).all() and counts[2].sum() == 0
    last = recorder.counts(list(amole.layers), 5, 3, last_token=True)
    assert (last[:2].sum(-1) == 2).all()
    with pytest.raises(AdapterError, match="not among"):
        recorder.counts(["elsewhere"], 5, 3)


def test_rows_outside_amole_share_the_batch(amole) -> None:  # noqa: ANN001
    a = assignment(amole, (0, 2, 3))
    amole.add_adapter("plain", LoraConfig(r=4, dropout=0.0), seed=7)
    for _, layer in amole.adapter_layers("plain"):
        with torch.no_grad():
            layer.adapters["plain"].lora_B.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    routing = AMoLERouting(groups=(a,), row_group=torch.tensor([0, -1, -1]))
    weights = torch.tensor([[0.0], [1.0], [0.0]])  # row 1: the plain adapter; row 2: base model
    with torch.no_grad(), amole.context.route_tokens(routing, ("plain",), weights):
        mixed = amole.model(IDS).logits
    alone = run(amole, [a], [0, 0, 0])
    with torch.no_grad(), amole.context.single("plain", 3):
        plain = amole.model(IDS).logits
    with torch.no_grad():
        base = amole.model(IDS).logits
    torch.testing.assert_close(mixed[0], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], plain[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[2], base[2], atol=1e-5, rtol=1e-5)


def test_expert_sources_select_a_prefixed_copy(amole) -> None:  # noqa: ANN001
    a = assignment(amole, (1, 2, 4))
    want = run(amole, [a], [0, 0, 0])
    config = LoraConfig(r=4, dropout=0.0)
    for name in [expert_name(j) for j in range(5)] + [SHARED]:
        amole.add_adapter(f"v2/{name}", config)
        amole.load_adapter_state(f"v2/{name}", {k: v.clone() for k, v in amole.adapter_state(name).items()})
    proj = {path: layer.token_proj.detach().clone() for path, layer in amole.layers.items()}
    with torch.no_grad():
        for layer in amole.layers.values():
            layer.token_proj.zero_()  # the layer's own P no longer matters
    source = AMoLEExperts(prefix="v2/", token_proj=proj, top_k=2, shared=True)
    got = run(amole, [a], [0, 0, 0], experts=(source,))
    torch.testing.assert_close(got, want)
    with pytest.raises(AdapterError, match="one source per group"):
        AMoLERouting(groups=(a, a), row_group=torch.tensor([0, 1]), experts=(source,))


@pytest.mark.parametrize("damage", ["no_weights", "missing_layer", "bad_id", "empty", "no_expert", "bad_proj"])
def test_a_damaged_amole_folder_is_refused_by_name_before_the_model_changes(amole, tmp_path, damage: str) -> None:  # noqa: ANN001
    import json

    from safetensors.torch import load_file, save_file

    from adapters.amole_io import load_amole, read_amole, save_amole
    from models import tiny_llama

    folder = save_amole(amole, tmp_path / "am", num_experts=5, assignments={"c0": assignment(amole, (0, 2))})
    raw = json.loads((folder / "assignments.json").read_text())
    first = next(iter(raw["c0"]))
    weights = folder / "amole_model.safetensors"
    state = load_file(str(weights))
    if damage == "no_weights":
        weights.unlink()
    elif damage in ("missing_layer", "bad_id", "empty"):
        raw["c0"][first] = {"missing_layer": None, "bad_id": [0, 5], "empty": []}[damage]
        raw["c0"] = {k: v for k, v in raw["c0"].items() if v is not None}
        (folder / "assignments.json").write_text(json.dumps(raw))
    elif damage == "no_expert":
        save_file({k: v for k, v in state.items() if ".expert_3." not in k}, str(weights))
    else:
        key = next(k for k in state if k.endswith("token_proj.weight"))
        save_file({**state, key: state[key][:, :-1].contiguous()}, str(weights))
    message = {"no_weights": "lacks amole_model", "missing_layer": "must assign experts in all",
               "bad_id": "expert id outside 0..4", "empty": "empty assignment", "no_expert": "lacks .*expert_3",
               "bad_proj": "token projection of .* misshapen"}[damage]
    fresh = inject(tiny_llama().model)
    with pytest.raises(AdapterError, match=message):
        data = read_amole(fresh, folder)
        for name in data.names:
            data.expert_state(name)
        for path in data.layers:
            data.token_proj(path, fresh.layers[path].in_features)
    with pytest.raises(AdapterError, match=message):
        load_amole(fresh, folder)
    assert not any(n.startswith("expert_") for n in fresh.configs)  # refused before any expert is created


def _union_and_per_client(amole, dtype: torch.dtype):  # noqa: ANN001, ANN202
    """(outputs, expert counts) of the batched-union path (no grad) and of the per-client path (grad on)."""
    groups = [per_layer_assignment(amole, 0), assignment(amole, (1, 4)), assignment(amole, (3,)),
              assignment(amole, (0, 2, 3, 4))]
    row_group = torch.tensor([3, -1, 0, 1, 2, 0, 1, 3])
    ids = torch.randint(0, 100, (8, 5), generator=torch.Generator().manual_seed(2))
    amole.model.to(dtype)
    outputs, counts = [], []
    for grad in (False, True):
        recorder = ExpertRecorder()
        routing = AMoLERouting(groups=tuple(groups), row_group=row_group, recorder=recorder)
        with torch.set_grad_enabled(grad), amole.context.route_tokens(routing):
            outputs.append(amole.model(ids).logits.detach().float())
        counts.append(recorder.counts(list(amole.layers), 5, 8))
    amole.model.to(torch.float32)
    return outputs, counts


def test_clients_batched_over_their_union_equal_the_per_client_path(amole) -> None:  # noqa: ANN001
    """Inference runs the clients of one source over the union of their experts (adapters.amole_union);
    with autograd on, each client runs alone. Both give the same outputs and the same expert choices,
    including a client holding one expert (k clipped to 1: its own pass) and a row outside AMoLE."""
    (union, alone), (union_counts, alone_counts) = _union_and_per_client(amole, torch.float32)
    torch.testing.assert_close(union, alone, atol=1e-5, rtol=1e-5)
    assert torch.equal(union_counts, alone_counts) and union_counts[1].sum() == 0  # the base row chose nothing


def test_in_bf16_the_union_path_is_as_close_to_fp32_as_the_per_client_path(amole) -> None:  # noqa: ANN001
    (reference, _), _ = _union_and_per_client(amole, torch.float32)
    (union, alone), _ = _union_and_per_client(amole, torch.bfloat16)
    # bf16 sums in another order per path, and a near-tied gate may then flip in one row (seen here: row 5):
    # compare the typical row's error with fp32, not the bits
    per_row = [(out - reference).abs().mean(dim=(1, 2)).median() for out in (union, alone)]
    assert per_row[0] <= 1.5 * per_row[1] + 1e-4


@pytest.fixture()
def vanilla(tiny: LoadedModel):  # noqa: ANN201
    """FedAMoLE-A's layers: 5 experts and a vanilla MoLE router W (5, d) per layer (paper 002 s5.5)."""
    return _experts(tiny, router="vanilla")


def test_vanilla_router_layers_route_with_their_assigned_rows(vanilla, tmp_path) -> None:  # noqa: ANN001
    from adapters.amole_io import load_amole, read_amole_meta, save_amole

    layer = next(iter(vanilla.layers.values()))
    assert layer.token_proj.shape == (5, layer.in_features)  # one row per assignable expert, whatever is held
    groups = [assignment(vanilla, (0, 2)), assignment(vanilla, (1, 3, 4))]
    # the union pass (inference) equals each client alone (autograd on): the same rows score the same experts
    outputs = []
    for grad in (False, True):
        routing = AMoLERouting(groups=tuple(groups), row_group=torch.tensor([0, 1, 0]), router="vanilla")
        with torch.set_grad_enabled(grad), vanilla.context.route_tokens(routing):
            outputs.append(vanilla.model(IDS).logits.detach())
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    routing = AMoLERouting(groups=(groups[0],), row_group=torch.tensor([0, 0, 0]), router="vanilla")
    with vanilla.context.route_tokens(routing):
        vanilla.model(IDS).logits.sum().backward()
    grad = layer.token_proj.grad
    assert grad is not None and grad[[0, 2]].abs().sum() > 0 and grad[[1, 3, 4]].abs().sum() == 0  # held rows only
    with torch.no_grad():
        amole_way = AMoLERouting(groups=(groups[0],), row_group=torch.tensor([0, 0, 0]))
        with pytest.raises(ValueError, match="shape mismatch"), vanilla.context.route_tokens(amole_way):
            vanilla.model(IDS)  # W is no token projection: the AMoLE gate refuses its shape
    save_amole(vanilla, tmp_path / "a", 5, {"c": groups[0]}, router="vanilla")
    assert read_amole_meta(tmp_path / "a")["router"] == "vanilla"
    from models import tiny_llama

    other = inject(tiny_llama().model)  # a fresh model: load_amole creates the vanilla routers from the folder
    assignments, _ = load_amole(other, tmp_path / "a")
    torch.testing.assert_close(next(iter(other.layers.values())).token_proj, layer.token_proj)
    with torch.no_grad():
        routing = AMoLERouting(groups=(assignments["c"],), row_group=torch.tensor([0, 0, 0]), router="vanilla")
        with other.context.route_tokens(routing):
            again = other.model(IDS).logits
        with vanilla.context.route_tokens(routing):
            torch.testing.assert_close(again, vanilla.model(IDS).logits, atol=1e-5, rtol=1e-5)
