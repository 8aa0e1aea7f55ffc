"""Client halves on the tiny model, one fit at a time: what each method trains, keeps and uploads."""

from __future__ import annotations

import pytest
import torch

from models import tiny_llama
from training.algorithms import get_method
from training.algorithms.feddpa import FedDPATClient
from training.algorithms.fedmcp import FedMCPClient, fedmcp_loss
from training.algorithms.fedoa import FedOAClient, fedoa_loss
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


def _naive_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """HSIC form with explicit kernels and centring matrix (Kornblith et al. 2019), in float64."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    H = torch.eye(n, dtype=torch.float64) - torch.ones(n, n, dtype=torch.float64) / n
    K, L = x @ x.T, y @ y.T
    hsic = lambda a, b: torch.trace(a @ H @ b @ H)  # noqa: E731
    return float(hsic(K, L) / torch.sqrt(hsic(K, K) * hsic(L, L)))


def _states(rt: Runtime, batch: dict[str, torch.Tensor], names: tuple[str, ...], weights: tuple[float, ...],
            pool: str) -> torch.Tensor:
    """Final-layer states with ``names`` on at ``weights``, pooled by a per-row loop (the naive reference)."""
    rows = batch["input_ids"].shape[0]
    with torch.no_grad(), rt.adapted.context.use(names, torch.tensor([list(weights)] * rows)):
        hidden = rt.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          output_hidden_states=True).hidden_states[-1]
    out = []
    for b in range(rows):
        real = [t for t in range(hidden.shape[1]) if batch["attention_mask"][b, t]]
        out.append(hidden[b, real].mean(0) if pool == "mean" else hidden[b, real[-1]])
    return torch.stack(out)


def test_fedmcp_uploads_only_the_global_and_its_contrast_is_the_papers_cka_difference(rt: Runtime) -> None:
    received = _received(rt, 2)
    ctx = _ctx(rt)
    res = FedMCPClient().fit(FitIns(round=0, state=received), ctx)
    assert set(res.state) == set(received) and "local" in ctx.private
    assert not _equal(res.state, received)  # the global trained too
    assert "cka_contrast" in res.metrics
    # L_c = CKA(X, Y) - CKA(X, Z) against explicit HSIC kernels on per-row pooled states
    rt.set("global", res.state)
    rt.set("received", received)
    rt.set("local", ctx.private["local"])
    batch = collate(rt.examples(ctx.data)[:4], pad_id=rt.tokenizer.pad_token_id)
    x = _states(rt, batch, ("global",), (1.0,), "mean")
    y = _states(rt, batch, ("global", "local"), (0.5, 0.5), "mean")
    z = _states(rt, batch, ("received",), (1.0,), "mean")
    w = torch.full((4, 2), 0.5)
    with torch.no_grad(), rt.adapted.context.use(("global", "local"), w):
        _, extra = fedmcp_loss(0.5, 0.05)(rt, batch, ("global", "local"), w)
        _, cos = fedmcp_loss(0.5, 0.05, "cosine")(rt, batch, ("global", "local"), w)
    want = _naive_cka(x, y) - _naive_cka(x, z)
    assert abs(want) > 1e-4 and extra["cka_contrast"] == pytest.approx(want, rel=1e-3, abs=1e-5)
    cosine = lambda a, b: float(sum(torch.dot(a[i], b[i]) / (a[i].norm() * b[i].norm()) for i in range(4)) / 4)  # noqa: E731
    assert cos["cka_contrast"] == pytest.approx(cosine(x, y) - cosine(x, z), rel=1e-3, abs=1e-6)
    # mu = 0 and gamma = 0 reduce the objective to the full model's LM loss
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
    assert set(res.state) == set(received) and "local_reg" in res.metrics and "local" in ctx.private
    # the regulariser against naive formulas on per-row last-token states of the two adapters
    rt.set("global", received)
    rt.set("local", ctx.private["local"])
    batch = collate(rt.examples(ctx.data)[:3], pad_id=rt.tokenizer.pad_token_id)
    a = _states(rt, batch, ("local",), (1.0,), "last").double()
    b = _states(rt, batch, ("global",), (1.0,), "last").double()
    if distance == "l2":
        want = float(((a - b) ** 2).sum().sqrt())  # the reference's torch.dist: unsquared, not averaged
    else:
        if distance == "pearson":
            a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
        want = float(sum(1 - torch.dot(a[i], b[i]) / (a[i].norm() * b[i].norm()) for i in range(3)) / 3)
    with torch.no_grad(), rt.adapted.context.use(("local",), torch.ones(3, 1)):
        _, extra = fedoa_loss(0.5, distance)(rt, batch, ("local",), torch.ones(3, 1))
    assert want > 1e-6 and extra["reg"] == pytest.approx(0.5 * want, rel=1e-3)


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


def test_feddpa_inside_fedprox_trains_the_global_as_fedprox_does(rt: Runtime) -> None:
    from training.algorithms.fedit import FedAvgClient

    received = _received(rt, 4)
    ins = FitIns(round=0, state=received)  # round 0: FedDPA-T trains the global step alone
    dpa = FedDPATClient(alpha=0.5, mu=50.0).fit(ins, _ctx(rt)).state
    prox = FedAvgClient(mu=50.0).fit(ins, _ctx(rt)).state
    plain = FedDPATClient(alpha=0.5).fit(ins, _ctx(rt)).state
    assert _equal(dpa, prox)  # the same global step as FedProx (same seed, same data)
    assert not _equal(dpa, plain)  # and the proximal term changes it
    # the proximal pull: closer to what was received than without it
    dist = lambda s: sum(float((s[k] - received[k]).pow(2).sum()) for k in s)  # noqa: E731
    assert dist(dpa) < dist(plain)
    client = get_method("feddpa-t").client({"mu": 0.1})
    assert client.prox.mu == 0.1 and get_method("feddpa-f").client({"mu": 0.1}).mu == 0.1
