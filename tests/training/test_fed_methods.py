"""Client halves on the tiny model, one fit at a time: what each method trains, keeps and uploads."""

from __future__ import annotations

import pytest
import torch

from models import tiny_llama
from training.algorithms import get_method
from training.algorithms.feddpa import FedDPATClient
from training.algorithms.fedmcp import FedMCPClient, fedmcp_loss
from training.algorithms.fedoa import FedOAClient
from training.algorithms.local import LocalClient, fresh_local, train_local
from training.data import collate, generate_suite
from training.protocol import ClientContext, FitIns
from training.runtime import Runtime, preset

DATA = generate_suite(n_train=6, n_test=1, families=["sorting", "capitals"])
TRAIN = preset("tiny")


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(tiny_llama(), TRAIN)


def _received(rt: Runtime, seed: int = 0) -> dict[str, torch.Tensor]:
    """A global adapter with a non-zero B, so that it really contributes to the forward."""
    state = rt.fresh("global", seed)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 if k.endswith("lora_B") else v for k, v in state.items()}


def _ctx(rt: Runtime, i: int = 0) -> ClientContext:
    c = DATA.clients[i]
    return ClientContext(c.client_id, c, rt, {}, seed=0)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_feddpa_t_local_step_never_moves_the_global(rt: Runtime) -> None:
    received = _received(rt)
    ctx = _ctx(rt)
    rt.set("global", received)
    fresh = fresh_local(ctx)
    assert all(float(v.abs().sum()) == 0 for k, v in fresh.items() if k.endswith("lora_B"))  # B = 0 at round 1
    train_local(ctx, 1, fresh, names=("global", "local"), weights=(0.5, 0.5))
    assert _equal(rt.get("global"), received)  # zero gradient into the global during the local step
    assert not _equal(ctx.private["local"], fresh)
    assert all(p.grad is None for p in rt.adapted.parameters_of(["global", "local"]))  # nothing lingers


def test_feddpa_t_round_zero_is_global_only_and_round_one_keeps_the_local_private(rt: Runtime) -> None:
    received = _received(rt, 1)
    client, ctx = FedDPATClient(alpha=0.3), _ctx(rt, 1)
    res0 = client.fit(FitIns(round=0, state=received), ctx)
    assert "local" not in ctx.private and not any(k.startswith("local_") for k in res0.metrics)
    res1 = client.fit(FitIns(round=1, state=res0.state), ctx)
    assert set(res1.state) == set(received)  # the global's keys only: the local adapter never leaves
    assert res1.bytes == sum(t.numel() * t.element_size() for t in received.values())
    assert "local_loss" in res1.metrics and "local" in ctx.private
    assert all(not torch.equal(ctx.private["local"][k], res1.state[k]) for k in res1.state)


def test_fedmcp_uploads_only_the_global_and_its_loss_has_the_cka_contrast(rt: Runtime) -> None:
    received = _received(rt, 2)
    ctx = _ctx(rt)
    res = FedMCPClient().fit(FitIns(round=0, state=received), ctx)
    assert set(res.state) == set(received) and "local" in ctx.private
    assert not _equal(res.state, received)  # the global trained too
    assert "cka_contrast" in res.metrics and abs(res.metrics["cka_contrast"]) <= 1.0
    # mu = 0 and gamma = 0 reduce the objective to the full model's LM loss
    rt.set("global", received)
    rt.set("received", received)
    rt.set("local", ctx.private["local"])
    batch = collate(rt.examples(ctx.data)[:2], pad_id=rt.tokenizer.pad_token_id)
    w = torch.full((2, 2), 0.5)
    with torch.no_grad(), rt.adapted.context.use(("global", "local"), w):
        loss, extra = fedmcp_loss(0.0, 0.0)(rt, batch, ("global", "local"), w)
        plain = rt.model(**batch).loss
    assert extra == {} and float(loss) == pytest.approx(float(plain), rel=1e-6)


@pytest.mark.parametrize("distance", ["l2", "cosine", "pearson"])
def test_fedoa_local_runs_alone_and_only_the_global_travels(rt: Runtime, distance: str) -> None:
    received = _received(rt, 3)
    ctx = _ctx(rt)
    ctx.private["local"] = received  # local == global: the regulariser starts at zero
    res = FedOAClient(lam=0.5, distance=distance).fit(FitIns(round=1, state=received), ctx)
    assert set(res.state) == set(received) and "local_reg" in res.metrics
    assert res.metrics["local_reg"] >= 0 and "local" in ctx.private


def test_local_baseline_uploads_nothing(rt: Runtime) -> None:
    ctx = _ctx(rt)
    res = LocalClient().fit(FitIns(round=0, state={}), ctx)
    assert res.state == {} and res.bytes == 0 and "local" in ctx.private


def test_fedprox_term_pulls_toward_the_received_global(rt: Runtime) -> None:
    received = _received(rt, 4)
    drift = {}
    for mu in (0.0, 1e4):
        client = get_method("fedprox").client({"mu": mu})
        res = client.fit(FitIns(round=0, state=received), _ctx(rt))
        drift[mu] = sum(float((res.state[k] - received[k]).norm()) for k in received)
    assert drift[1e4] < drift[0.0]
