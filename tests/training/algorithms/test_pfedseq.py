"""pFedSeq: the server protocol, its checkpoint, the client, ablations and tiny-model runs
(the sequence learners: test_pfedseq_learner.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters import LoraConfig
from adapters.rundir import RunDir
from models import tiny_llama
from training.algorithms import get_method
from training.algorithms.pfedseq.history import Layout, calibrate
from training.algorithms.pfedseq.learners import make_learner
from training.algorithms.pfedseq.method import RECEIVED, PFedSeqClient, PFedSeqConfig, PFedSeqStrategy, checksum
from training.data import generate_suite
from training.federation.checkpoint import load_round, save_round
from training.federation.rounds import RoundConfig
from training.local.runtime import Runtime, preset
from training.protocol import ClientContext, FitIns, FitRes
from training.simulation import SimConfig, run_federated

CLIENTS = ["a", "b", "c"]


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.{m}.lora_{ab}": torch.randn(shape, generator=g) * scale
            for i in (0, 1, 10) for m in ("q_proj", "v_proj") for ab, shape in (("A", (2, 5)), ("B", (3, 2)))}


def test_layout_groups_by_backbone_layer_and_round_trips() -> None:
    state = _state(0)
    layout = Layout.from_state(state)
    assert [g[0] for g in layout.groups] == ["model.layers.0", "model.layers.1", "model.layers.10"]
    assert layout.size == sum(v.numel() for v in state.values()) and layout.groups[1][1] == layout.groups[0][2]
    back = layout.unflatten(layout.flatten(state))
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert Layout.from_dict(json.loads(json.dumps(layout.asdict()))) == layout
    with pytest.raises(ValueError, match="keys differ"):
        layout.flatten({k: v for k, v in state.items() if "layers.1." not in k})


def _results(round_idx: int) -> list[FitRes]:
    """Each client's upload: a deterministic update (scale 1e-3, like LoRA updates) and its data size."""
    return [FitRes(c, _state(100 * round_idx + i, 1e-3), 2 + i) for i, c in enumerate(CLIENTS)]


def _play(strategy: PFedSeqStrategy, state: dict[str, torch.Tensor], rounds: range):
    sent, globals_ = [], []
    for r in rounds:
        ins = strategy.configure_round(r, CLIENTS, state)
        sent.append({c: ins[c].state for c in CLIENTS})
        globals_.append(state)
        res = _results(r)
        new = strategy.aggregate(r, res, [], state)
        assert new is not None
        # eq 1: data-size FedAvg of theta_hat_i = what was sent + the update
        total = sum(x.num_examples for x in res)
        for k in state:
            want = sum(x.num_examples / total * (sent[-1][x.client_id][k] + x.state[k]) for x in res)
            assert torch.allclose(new[k], want, atol=1e-6)
        state = new
    return state, sent, globals_


def test_warm_up_rounds_send_the_global_then_the_calibrated_adapters() -> None:
    strategy = PFedSeqStrategy(PFedSeqConfig(warmup=2, window=2, server_device="cpu", chunk=5), seed=0)
    state = _state(0, 0.1)
    state, sent, globals_ = _play(strategy, state, range(3))
    assert all(torch.equal(sent[r][c][k], globals_[r][k])
               for r in (0, 1, 2) for c in CLIENTS for k in state)  # rounds t = 1..3: t - 1 <= W, the global
    learner0 = [p.clone() for p in strategy.learners.parameters()]
    ins = strategy.configure_round(3, CLIENTS, state)  # t = 3 > W: global + xi_i
    assert all(ins[c].config["personalized"] for c in CLIENTS)
    layout = strategy.layout
    expected = torch.cat([calibrate(learner, strategy.history.steps, s, e, 1000)
                          for learner, (_, s, e) in zip(strategy.learners, layout.groups, strict=True)], dim=1)
    for i, c in enumerate(CLIENTS):
        got = layout.flatten(ins[c].state) - layout.flatten(state)
        assert torch.allclose(got, expected[i], atol=1e-6)
    assert not torch.allclose(layout.flatten(ins["a"].state), layout.flatten(ins["b"].state))
    assert all(torch.equal(a, b) for a, b in zip(learner0, strategy.learners.parameters(), strict=True))


def test_strategy_state_round_trips_through_the_checkpoint_and_continues_identically(tmp_path: Path) -> None:
    cfg = PFedSeqConfig(warmup=1, window=2, server_device="cpu", chunk=8)
    first = PFedSeqStrategy(cfg, seed=3)
    state, _, _ = _play(first, _state(0, 0.1), range(3))
    run = RunDir(tmp_path)
    folder = save_round(run, 2, state, first.state_dict(), {}, LoraConfig(), "tiny", peft_global=False)
    text = (folder / "strategy.json").read_text()
    assert len(text) < 20_000 and '{"__tensor__": "history/1"}' in text  # tensors live beside it, not in it
    _, loaded, _ = load_round(run, 2)
    assert isinstance(loaded["calib"], torch.Tensor) and len(loaded["history"]) == 2
    second = PFedSeqStrategy(cfg, seed=3)
    second.load_state_dict(loaded)
    end_a, sent_a, _ = _play(first, state, range(3, 5))
    end_b, sent_b, _ = _play(second, state, range(3, 5))
    assert all(torch.equal(end_a[k], end_b[k]) for k in end_a)
    assert all(torch.equal(sent_a[r][c][k], sent_b[r][c][k]) for r in (0, 1) for c in CLIENTS for k in end_a)


def test_a_state_of_another_version_or_a_longer_window_is_refused() -> None:
    first = PFedSeqStrategy(PFedSeqConfig(warmup=0, window=3, server_device="cpu"), seed=0)
    _play(first, _state(0, 0.1), range(3))
    with pytest.raises(ValueError, match="version 1 checkpoints"):
        PFedSeqStrategy(PFedSeqConfig(server_device="cpu")).load_state_dict({"version": 1, "roster": CLIENTS})
    with pytest.raises(ValueError, match="more than the window L = 2"):
        PFedSeqStrategy(PFedSeqConfig(window=2, server_device="cpu")).load_state_dict(first.state_dict())


def test_an_upload_trained_from_another_adapter_than_sent_is_refused() -> None:
    strategy = PFedSeqStrategy(PFedSeqConfig(warmup=0, window=2, server_device="cpu"))
    state, _, _ = _play(strategy, _state(0, 0.1), range(1))
    ins = strategy.configure_round(1, CLIENTS, state)  # personalized: each client its own adapter
    honest = [FitRes(r.client_id, r.state, r.num_examples, {RECEIVED: checksum(ins[r.client_id].state)})
              for r in _results(1)]
    broadcast = [FitRes(r.client_id, r.state, r.num_examples, {RECEIVED: checksum(state)}) for r in _results(1)]
    with pytest.raises(ValueError, match="trained from another adapter"):
        strategy.aggregate(1, broadcast, [], state)  # a runtime that sent everyone the global
    assert strategy.aggregate(1, honest, [], state) is not None


def test_a_client_outside_the_roster_is_refused_clearly() -> None:
    strategy = PFedSeqStrategy(PFedSeqConfig(clients=("a", "b"), server_device="cpu"))
    with pytest.raises(ValueError, match="joined later"):
        strategy.configure_round(0, ["a", "z"], _state(0))
    with pytest.raises(ValueError, match="learner must be one of"):
        PFedSeqConfig.from_options({"learner": "transformer"})
    assert PFedSeqConfig.from_options({"clients": "x,y", "window": "3"}).clients == ("x", "y")


def test_client_uploads_the_update_and_keeps_the_trained_adapter_private() -> None:
    rt = Runtime(tiny_llama(), preset("tiny"))
    data = generate_suite(n_train=4, n_test=1, families=["sorting"])
    ctx = ClientContext(data.clients[0].client_id, data.clients[0], rt, {}, seed=0)
    received = rt.fresh("global", 5)
    res = PFedSeqClient().fit(FitIns(round=0, state=received), ctx)
    assert set(res.state) == set(received) and res.num_examples == 4
    assert all(torch.allclose(received[k] + res.state[k], ctx.private["local"][k], atol=1e-7) for k in received)
    assert res.metrics[RECEIVED] == pytest.approx(checksum(received))
    assert any(float(v.abs().max()) > 0 for v in res.state.values())


DATA_OPTIONS = {"n_train": 4, "n_test": 1, "families": ["sorting", "capitals"]}
OPTIONS = {"warmup": 1, "window": 2, "server_device": "cpu"}


def _run(out: Path, rounds: int, resume: bool = False) -> RunDir:
    run_federated("pfedseq", generate_suite(**DATA_OPTIONS), tiny_llama(), out,
                  SimConfig(RoundConfig(rounds=rounds), embed=False), preset("tiny"), OPTIONS, resume=resume,
                  data_spec="generated", data_options=DATA_OPTIONS)
    return RunDir(out)


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


def test_three_rounds_on_the_tiny_model_and_resume_equals_a_straight_run(tmp_path: Path) -> None:
    straight = _run(tmp_path / "straight", 3)
    rows = [json.loads(x) for x in straight.metrics.read_text().splitlines()]
    agg = [x for x in rows if x.get("aggregate")]
    assert [x["personalized_next"] for x in agg] == [0.0, 1.0, 1.0]  # W = 1
    assert agg[0]["learner_grad_norm"] == 0.0 and agg[1]["learner_grad_norm"] > 0  # no update at t = 1
    assert straight.read_config()["inference_weight"] == 1.0 and get_method("pfedseq").has_local
    locals_ = {c: _adapter(straight.local_adapter(c)) for c in ("sorting", "capitals")}
    assert any(not torch.equal(locals_["sorting"][k], locals_["capitals"][k]) for k in locals_["sorting"])
    cut = _run(tmp_path / "cut", 2)
    assert (cut.round_dir(0) / "STRATEGY_PRUNED").is_file()  # only the newest round keeps the resume tensors
    assert not (cut.round_dir(0) / "strategy.safetensors").exists()
    assert (cut.round_dir(1) / "strategy.safetensors").is_file()
    resumed = _run(tmp_path / "cut", 3, resume=True)
    a, b = _adapter(straight.global_adapter), _adapter(resumed.global_adapter)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for c in ("sorting", "capitals"):
        la, lb = locals_[c], _adapter(resumed.local_adapter(c))
        assert all(torch.equal(la[k], lb[k]) for k in la)


def test_personal_state_is_the_final_global_plus_the_last_calibration() -> None:
    strategy = PFedSeqStrategy(PFedSeqConfig(warmup=1, window=2, server_device="cpu", chunk=5), seed=0)
    state, _, _ = _play(strategy, _state(0, 0.1), range(3))
    layout = strategy.layout
    last = torch.cat([calibrate(learner, strategy.history.steps, s, e, 1000)
                      for learner, (_, s, e) in zip(strategy.learners, layout.groups, strict=True)], dim=1)
    assert float(last.abs().max()) > 0
    for i, c in enumerate(CLIENTS):
        personal = strategy.personal_state(c, state)
        assert personal is not None
        torch.testing.assert_close(layout.flatten(personal) - layout.flatten(state), last[i], rtol=1e-5, atol=1e-6)
    assert strategy.personal_state("stranger", state) is None
    warm = PFedSeqStrategy(PFedSeqConfig(warmup=5, window=2, server_device="cpu"), seed=0)
    state, _, _ = _play(warm, _state(0, 0.1), range(2))  # still in the warm-up: the personal model is the global
    assert all(torch.equal(warm.personal_state("a", state)[k], state[k]) for k in state)


def test_run_serves_algorithm_1s_personalized_adapter(tmp_path: Path) -> None:
    run = _run(tmp_path / "r", 3)
    _, strategy_state, _ = load_round(run, 2)
    layout = Layout.from_dict(strategy_state["layout"])

    def flat(folder: Path) -> torch.Tensor:  # PEFT file keys -> state keys
        peft = _adapter(folder)
        return layout.flatten({k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in peft.items()})

    glob = flat(run.global_adapter)
    for i, c in enumerate(strategy_state["roster"]):
        mine = flat(run.local_adapter(c))
        torch.testing.assert_close(mine - glob, strategy_state["calib"][i].float(), rtol=1e-4, atol=1e-6)


def test_ablation_a_builds_on_each_clients_own_adapter() -> None:
    strategy = PFedSeqStrategy(PFedSeqConfig(warmup=5, window=2, server_device="cpu", aggregation=False), seed=0)
    state, sent, _ = _play(strategy, _state(0, 0.1), range(2))
    ins = strategy.configure_round(2, CLIENTS, state)  # no calibration yet (warm-up): theta_hat_i itself
    for c, res in zip(CLIENTS, _results(1), strict=True):
        assert all(torch.allclose(ins[c].state[k], sent[1][c][k] + res.state[k], atol=1e-7) for k in state)
    assert not torch.allclose(strategy.layout.flatten(ins["a"].state), strategy.layout.flatten(state))


@pytest.mark.parametrize("kind", ["ssm", "lstm", "mlp"])
def test_ablation_c_calibrates_each_client_from_its_own_sequence_only(kind: str) -> None:
    from training.algorithms.pfedseq.learners import OwnSequence

    torch.manual_seed(0)
    learner = OwnSequence(make_learner(kind, 1, 4, backend="torch"))
    x = torch.randn(5, 3, 4)  # [b, l, N]
    y = x.clone()
    y[:, :, 2] += 1.0  # client 2's updates change
    out_x, out_y = learner(x), learner(y)
    assert out_x.shape == (5, 4)
    torch.testing.assert_close(out_x[:, [0, 1, 3]], out_y[:, [0, 1, 3]])  # nobody else's calibration moves
    assert not torch.allclose(out_x[:, 2], out_y[:, 2])
    alone = learner.learner(x[:, :, 2:3])[:, 0]  # the same single-channel learner on client 2's sequence alone
    torch.testing.assert_close(out_x[:, 2], alone)


@pytest.mark.parametrize("option", [{"aggregation": False}, {"cross_client": False}, {"personalize": "trained"}])
def test_ablations_run_from_the_options(tmp_path: Path, option: dict) -> None:
    data = generate_suite(**DATA_OPTIONS)
    run_federated("pfedseq", data, tiny_llama(), tmp_path / "r", SimConfig(RoundConfig(rounds=2), embed=False),
                  preset("tiny"), {**OPTIONS, **option}, data_spec="generated", data_options=DATA_OPTIONS)
    run = RunDir(tmp_path / "r")
    assert run.read_config()["options"][next(iter(option))] == next(iter(option.values()))
    for c in data.client_ids:
        assert (run.local_adapter(c) / "adapter_model.safetensors").is_file()
