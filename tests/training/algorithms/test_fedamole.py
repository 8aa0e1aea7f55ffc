"""FedAMoLE end to end on the tiny model: assignments, what travels, aggregation over holders, export,
embedding noise, and the paper's ablations as reached from ``fedmosaic train --option``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters import inject
from adapters.amole_io import load_amole
from adapters.amole_layer import SHARED
from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_llama
from training.algorithms.fedamole.method import EMB, FedAMoLEClient, FedAMoLEStrategy, _cfg
from training.algorithms.fedamole.rsea import AMoLEConfig, assign_experts
from training.data import generate_suite
from training.federation.checkpoint import load_round
from training.federation.rounds import RoundConfig
from training.local.runtime import Runtime, preset
from training.protocol import ClientContext, FitRes
from training.simulation import SimConfig, run_federated
from training.state import derive_seed

DATA = generate_suite(n_train=6, n_test=2, families=["sorting", "capitals", "arithmetic", "sentiment"])
OPTS = {"num_experts": 4, "max_experts": 3, "expert_choices": 2}


def test_two_rounds_assign_train_and_export(tmp_path: Path) -> None:
    summary = run_federated("fedamole", DATA, tiny_llama(), tmp_path / "am", SimConfig(RoundConfig(rounds=2)),
                            preset("tiny"), OPTS, data_spec="generated")
    run = RunDir(tmp_path / "am")
    client_rows = [json.loads(x) for x in run.metrics.read_text().splitlines() if '"status": "ok"' in x]
    for r in (0, 1):  # each round's reported loss is the mean of its clients' losses, and finite
        mine = [x["loss"] for x in client_rows if x["round"] == r]
        assert len(mine) == len(DATA.client_ids) and math.isfinite(summary.losses[r])
        assert summary.losses[r] == pytest.approx(sum(mine) / len(mine), rel=1e-9)
    assert summary.failures == []
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


def _pair(order: list[str]) -> tuple[FedAMoLEStrategy, dict]:
    """A strategy that aggregated round 0 from uploads arriving in ``order``, and its round-1 instructions."""
    strategy = FedAMoLEStrategy(AMoLEConfig(num_experts=3, max_experts=2, min_experts=1, expert_choices=1))
    state = {f"m.expert_{j}.lora_A": torch.zeros(1) for j in range(3)} | {"m.token_proj": torch.zeros(1)}
    strategy.configure_round(0, ["a", "b"], state)
    emb = {"a": {f"{EMB}m.client": torch.tensor([1.0, 0.0]), f"{EMB}m.expert_0": torch.tensor([5.0, 0.0]),
                 f"{EMB}m.expert_2": torch.tensor([4.0, 0.0])},
           "b": {f"{EMB}m.client": torch.tensor([0.0, 1.0]), f"{EMB}m.expert_1": torch.tensor([0.0, 5.0]),
                 f"{EMB}m.expert_2": torch.tensor([0.0, 2.0])}}
    strategy.aggregate(0, [FitRes(c, emb[c], 1) for c in order], [], state)
    return strategy, strategy.configure_round(1, ["a", "b"], state)


def test_relevance_follows_clients_not_upload_order() -> None:
    # A Flower server receives replies as nodes finish; the scores' columns must still match the clients.
    for order in (["a", "b"], ["b", "a"]):
        _, ins = _pair(order)
        assert ins["a"].config["assignment"] == {"m": [0, 2]} and ins["b"].config["assignment"] == {"m": [1]}
    restored = FedAMoLEStrategy(AMoLEConfig(num_experts=3, max_experts=2, min_experts=1, expert_choices=1))
    restored.load_state_dict(json.loads(json.dumps(_pair(["b", "a"])[0].state_dict())))
    assert restored.score_clients == ["b", "a"]


def _fit(options: dict, ins, data, rt: Runtime) -> FitRes:  # noqa: ANN001
    # Every fit starts from ``ins`` (loaded into the shared runtime), as in the simulator.
    return FedAMoLEClient(_cfg({**OPTS, **options}), 0).fit(ins, ClientContext(data.client_id, data, rt, {}, 0))


def test_embedding_noise_moves_only_the_uploaded_embeddings(tiny) -> None:  # noqa: ANN001
    rt = Runtime(tiny, preset("tiny"))
    strategy = FedAMoLEStrategy(_cfg(OPTS))
    ins = strategy.configure_round(0, DATA.client_ids, strategy.initial_state(rt))["sorting"]
    data = DATA.client("sorting")
    clean = _fit({}, ins, data, rt)
    sigma = 0.5
    noisy = _fit({"embed_noise": sigma}, ins, data, rt)
    again = _fit({"embed_noise": sigma}, ins, data, rt)
    assert set(clean.state) == set(noisy.state) and clean.metrics == noisy.metrics
    weights = [k for k in clean.state if not k.startswith(EMB)]
    assert weights and all(torch.equal(clean.state[k], noisy.state[k]) for k in weights)  # training untouched
    embs = [k for k in clean.state if k.startswith(EMB)]
    diff = torch.cat([(noisy.state[k] - clean.state[k]).double().flatten() for k in embs])  # (n,)
    n = diff.numel()
    assert n >= 64 and abs(float(diff.mean())) < 4 * sigma / n**0.5  # zero-mean Gaussian ...
    assert 0.75 * sigma < float(diff.std()) < 1.25 * sigma  # ... of standard deviation sigma
    assert all(torch.equal(noisy.state[k], again.state[k]) for k in embs)  # drawn from (seed, round, client)
    dp = _fit({"dp_noise": True, "dp_eta": 10.0}, ins, data, rt)  # the reference's Gamma-magnitude noise
    assert all(torch.equal(clean.state[k], dp.state[k]) for k in weights)
    assert not all(torch.equal(clean.state[k], dp.state[k]) for k in embs)


def test_options_are_checked() -> None:
    assert _cfg({"shared-expert": False, "seed": 3}).shared_expert is False  # CLI spelling accepted
    with pytest.raises(ValueError, match="shared_exprt"):
        _cfg({"shared_exprt": False})
    with pytest.raises(ValueError, match="shared_expert must be true or false"):
        _cfg({"shared_expert": "no"})
    with pytest.raises(ValueError, match="embed_noise"):
        _cfg({"embed_noise": -1.0})
    with pytest.raises(ValueError, match="not both"):
        _cfg({"embed_noise": 0.1, "dp_noise": True})
    # The paper's 30 experts x 2 choices need >= 8 clients at 8 experts each: the error names what fits.
    with pytest.raises(ValueError, match=r"3 clients.*num_experts between 3 and 12 .*num_experts=12"):
        FedAMoLEStrategy(_cfg({})).configure_round(0, ["a", "b", "c"], {"m.token_proj": torch.zeros(1)})


ABLATIONS = {
    "rsea": [],
    "static": ["assignment=static"],  # FedMoLE
    "random": ["assignment=random"],  # FedAMoLE-R
    "homogeneous": ["homogeneous=true"],
    "no_shared": ["shared_expert=false"],  # FedAMoLE-S
    "embed_noise": ["embed_noise=0.05"],
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablations_from_the_command_line(tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    opts = ["num_experts=4", "max_experts=3", *ABLATIONS[name]]
    argv = ["train", "--method", "fedamole", "--data", "generated", "--model", "tiny", "--preset", "tiny", "--rounds",
            "2", "--n-train", "6", "--n-test", "2", "--families", ",".join(DATA.client_ids), "--out", str(out)]
    assert main(argv + [x for o in opts for x in ("--option", o)]) == 0
    run = RunDir(out)
    cfg = _cfg(run.read_config()["options"])
    rounds = [json.loads((run.round_dir(r) / "strategy.json").read_text()) for r in (0, 1)]
    modules = sorted(rounds[0]["assignment"])
    clients = DATA.client_ids
    if cfg.assignment == "static":  # FedMoLE: round 0's random assignment kept
        expected = rounds[0]["assignment"]
    elif cfg.assignment == "random":  # FedAMoLE-R: a fresh random draw
        expected = assign_experts(None, cfg, clients, modules, torch.Generator().manual_seed(derive_seed(0, "rsea", 1)))
    else:  # RSEA from the relevance scores of round 0's uploads
        scores = {m: torch.tensor(v, dtype=torch.float64) for m, v in rounds[0]["scores"].items()}
        expected = assign_experts(scores, cfg, clients, modules)
    assert rounds[1]["assignment"] == expected
    if name in ("rsea", "random", "static"):  # with this seed, only FedMoLE keeps round 0's assignment
        assert (rounds[1]["assignment"] == rounds[0]["assignment"]) is (name == "static")
    loads = {len(ids) for per in rounds[1]["assignment"].values() for ids in per.values()}
    assert loads <= ({2} if cfg.homogeneous else {2, 3})  # 4 experts x 2 choices over 4 clients
    meta = json.loads((run.amole / "amole_config.json").read_text())
    keys = load_file(str(run.amole / "amole_model.safetensors"))
    assert meta["shared_expert"] is cfg.shared_expert
    assert any(SHARED in k for k in keys) is cfg.shared_expert
    assert cfg.embed_noise == (0.05 if name == "embed_noise" else 0.0)
    adapted = inject(tiny_llama().model)
    assert load_amole(adapted, run.amole)[0] == {c: {m: tuple(rounds[1]["assignment"][m][c]) for m in modules}
                                                 for c in clients}


def test_load_balance_loss_leaves_padding_out(tiny) -> None:  # noqa: ANN001
    """The padded batch's load-balance term equals the one over the same sequences' real tokens run alone."""
    from adapters.amole import load_balance_loss
    from adapters.amole_routing import AMoLERouting
    from training.algorithms.fedamole.method import amole_loss, ensure_experts
    from training.data import collate

    rt = Runtime(tiny, preset("tiny"))
    cfg = _cfg(OPTS)
    ensure_experts(rt, cfg, 0)
    assignment = {path: [0, 1, 2] for path in rt.adapted.layers}
    rt.model.eval()
    examples = sorted(rt.examples(DATA.client("sorting")), key=lambda e: len(e.input_ids))
    short, long = examples[0], examples[-1]
    assert len(short.input_ids) < len(long.input_ids)  # the batch below is right-padded
    batch = collate([short, long], pad_id=rt.tokenizer.pad_token_id, device=rt.device)
    _, extra = amole_loss(cfg, assignment)(rt, batch, (), torch.zeros(2, 0))  # with grad: the layers record stats
    per_module: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    padded: list[torch.Tensor] = []
    for ex in (short, long, None):
        b = batch if ex is None else collate([ex], pad_id=rt.tokenizer.pad_token_id, device=rt.device)
        routing = AMoLERouting(groups=(assignment,), row_group=torch.zeros(b["input_ids"].shape[0], dtype=torch.long),
                               top_k=cfg.top_k)
        with rt.adapted.context.route_tokens(routing):
            rt.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        for path, g, idx in routing.stats:
            if ex is None:
                padded.append(load_balance_loss(g.detach(), idx))  # every position, padding included
            else:
                per_module.setdefault(path, []).append((g, idx))
    reference = sum(float(load_balance_loss(torch.cat([g.detach() for g, _ in v]), torch.cat([i for _, i in v])))
                    for v in per_module.values())
    assert extra["load_balance"] == pytest.approx(reference, rel=1e-4)
    assert float(sum(padded)) != pytest.approx(reference, rel=1e-4)  # counting the padding would differ


def test_local_export_writes_each_clients_last_round_experts(tmp_path: Path) -> None:
    run_federated("fedamole", DATA, tiny_llama(), tmp_path / "am", SimConfig(RoundConfig(rounds=1)), preset("tiny"),
                  {**OPTS, "export": "local"}, data_spec="generated")
    run = RunDir(tmp_path / "am")
    aggregated = load_file(str(run.amole / "amole_model.safetensors"))
    _, strategy_state, _ = load_round(run, 0)
    for client in DATA.client_ids:
        folder = run.client_dir(client) / "amole"
        assert json.loads((folder / "assignments.json").read_text()).keys() == {client}
        mine = load_file(str(folder / "amole_model.safetensors"))
        uploaded = strategy_state["local"][client]
        proj = [k for k in uploaded if k.endswith("token_proj")]
        assert proj
        for key in proj:  # the client's own projection, not the average over clients
            file_key = f"base_model.model.{key}.weight"
            assert torch.equal(mine[file_key], uploaded[key]) and not torch.equal(mine[file_key], aggregated[file_key])
