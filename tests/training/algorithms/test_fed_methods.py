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
from training.local.runtime import Runtime, preset
from training.protocol import ClientContext, FitIns

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


@pytest.mark.parametrize("method", ["feddpa-t", "fedoa"])
def test_local_adapter_trains_from_round_zero_and_stays_private(rt: Runtime, method: str) -> None:
    # paper 000 Alg. 2 / paper 001 Alg. 1 train the local adapter every round, round 0 included
    received = _received(rt, 1)
    client, ctx = get_method(method).client({"alpha": 0.3}), _ctx(rt, 1)
    res0 = client.fit(FitIns(round=0, state=received), ctx)
    assert "local" in ctx.private and res0.metrics["local_steps"] >= 1
    assert any(float(v.abs().sum()) > 0 for k, v in ctx.private["local"].items() if k.endswith("lora_B"))
    res1 = client.fit(FitIns(round=1, state=res0.state), ctx)
    assert set(res1.state) == set(received)  # the global's keys only: the local adapter never leaves
    assert res1.bytes == sum(t.numel() * t.element_size() for t in received.values())
    assert "local_loss" in res1.metrics and "local" in ctx.private
    assert all(not torch.equal(ctx.private["local"][k], res1.state[k]) for k in res1.state)
    # the reference code's reading stays an option: round 0 trains the global alone
    old, ctx_old = get_method(method).client({"local_from": 1}), _ctx(rt, 1)
    res_old = old.fit(FitIns(round=0, state=received), ctx_old)
    assert "local" not in ctx_old.private and not any(k.startswith("local_") for k in res_old.metrics)
    with pytest.raises(ValueError, match="local_from"):
        get_method(method).client({"local_from": 2})


def _naive_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """HSIC form with explicit kernels and centring matrix (Kornblith et al. 2019), in float64."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    H = torch.eye(n, dtype=torch.float64) - torch.ones(n, n, dtype=torch.float64) / n
    K, L = x @ x.T, y @ y.T
    hsic = lambda a, b: torch.trace(a @ H @ b @ H)  # noqa: E731
    return float(hsic(K, L) / torch.sqrt(hsic(K, K) * hsic(L, L)))


def _naive_unbiased_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """CKA from Song et al. (2012)'s unbiased HSIC written as its sum over distinct index tuples, float64."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    K, L = x @ x.T, y @ y.T

    def hsic(a: torch.Tensor, b: torch.Tensor) -> float:
        # (1/(n)_2) sum_{i!=j} a_ij b_ij + (1/(n)_4) sum_{i,j,q,r distinct} a_ij b_qr
        #   - (2/(n)_3) sum_{i,j,q distinct} a_ij b_iq
        idx = range(n)
        t1 = sum(float(a[i, j] * b[i, j]) for i in idx for j in idx if i != j) / (n * (n - 1))
        t2 = sum(float(a[i, j] * b[q, r]) for i in idx for j in idx for q in idx for r in idx
                 if len({i, j, q, r}) == 4) / (n * (n - 1) * (n - 2) * (n - 3))
        t3 = sum(float(a[i, j] * b[i, q]) for i in idx for j in idx for q in idx
                 if len({i, j, q}) == 3) / (n * (n - 1) * (n - 2))
        return t1 + t2 - 2 * t3

    return hsic(K, L) / (hsic(K, K) * hsic(L, L)) ** 0.5


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
    # L_c = CKA(X, Y) - CKA(X, Z), Y the PRIVATE adapter's states (paper 004 Eq. 5, DESIGN.md CKA(g, p)),
    # against explicit kernels on per-row pooled states
    rt.set("global", res.state)
    rt.set("received", received)
    local = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) if k.endswith("lora_B")
             else v for k, v in ctx.private["local"].items()}  # a private adapter far from the global
    rt.set("local", local)
    batch = collate(rt.examples(ctx.data)[:5], pad_id=rt.tokenizer.pad_token_id)
    x = _states(rt, batch, ("global",), (1.0,), "mean")
    p = _states(rt, batch, ("local",), (1.0,), "mean")
    full = _states(rt, batch, ("global", "local"), (0.5, 0.5), "mean")
    z = _states(rt, batch, ("received",), (1.0,), "mean")
    w = torch.full((5, 2), 0.5)
    with torch.no_grad(), rt.adapted.context.use(("global", "local"), w):
        _, paper = fedmcp_loss(0.5, 0.05)(rt, batch, ("global", "local"), w)
        _, old = fedmcp_loss(0.5, 0.05, private_y=False, unbiased=False)(rt, batch, ("global", "local"), w)
        _, cos = fedmcp_loss(0.5, 0.05, "cosine")(rt, batch, ("global", "local"), w)
    want = _naive_unbiased_cka(x, p) - _naive_unbiased_cka(x, z)
    assert abs(want) > 1e-4 and paper["cka_contrast"] == pytest.approx(want, rel=1e-3, abs=1e-5)
    # the former reading (Y = the full model, biased CKA) is an option, and it differs from the paper's
    legacy = _naive_cka(x, full) - _naive_cka(x, z)
    assert old["cka_contrast"] == pytest.approx(legacy, rel=1e-3, abs=1e-5)
    assert abs(legacy - want) > 1e-3
    cosine = lambda a, b: float(sum(torch.dot(a[i], b[i]) / (a[i].norm() * b[i].norm()) for i in range(5)) / 5)  # noqa: E731
    assert cos["cka_contrast"] == pytest.approx(cosine(x, p) - cosine(x, z), rel=1e-3, abs=1e-6)
    # mu = 0 and gamma = 0 reduce the objective to the full model's LM loss
    with torch.no_grad(), rt.adapted.context.use(("global", "local"), w):
        loss, extra = fedmcp_loss(0.0, 0.0)(rt, batch, ("global", "local"), w)
        plain = rt.model(**batch).loss
    assert extra == {} and float(loss) == pytest.approx(float(plain), rel=1e-6)


def test_fedmcp_contrast_trains_the_private_adapter() -> None:
    # Y = the private adapter's states: the contrast term alone (gamma 0, tiny LM weight) moves it
    tiny = Runtime(tiny_llama(), TRAIN)
    ctx = _ctx(tiny)
    batch = collate(tiny.examples(ctx.data)[:5], pad_id=tiny.tokenizer.pad_token_id)
    tiny.set("global", _received(tiny, 5))
    tiny.set("received", _received(tiny, 6))
    tiny.set("local", _received(tiny, 7))
    w = torch.full((5, 2), 0.5)
    grads = {}
    for private in (True, False):
        tiny.adapted.set_trainable(["global", "local"])
        with tiny.adapted.context.use(("global", "local"), w, trainable=("global", "local")):
            loss, _ = fedmcp_loss(0.5, 1.0, private_y=private)(tiny, batch, ("global", "local"), w)
            full, _ = fedmcp_loss(0.5, 0.0)(tiny, batch, ("global", "local"), w)
        params = tiny.adapted.parameters_of(["local"])
        g_term = torch.autograd.grad(loss - full, params, allow_unused=True)
        grads[private] = sum(float(g.abs().sum()) for g in g_term if g is not None)
        tiny.adapted.set_trainable(())
    assert grads[True] > 0 and grads[False] > 0 and grads[True] != pytest.approx(grads[False])


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


def test_fedoa_distance_keeps_its_weight_at_a_presets_batch() -> None:
    # The unsquared Frobenius norm over B rows grows like sqrt(B): at batch 8 it would weigh half of the
    # paper's batch-32 value. norm_batch (default 32) rescales it; norm_batch=0 is the reference's value.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    big_a, big_b = a.repeat(4, 1), b.repeat(4, 1)  # 32 rows of the same distribution
    lam = 0.5
    paper = fedoa_loss(lam, "l2", FedOAClient().norm_batch)._term
    assert float(paper(a, b)) == pytest.approx(float(paper(big_a, big_b)), rel=1e-5)
    assert float(paper(big_a, big_b)) == pytest.approx(lam * float(torch.dist(big_a, big_b)), rel=1e-5)
    raw = fedoa_loss(lam, "l2", 0)
    assert float(raw._term(big_a, big_b)) == pytest.approx(2 * float(raw._term(a, b)), rel=1e-5)
    assert get_method("fedoa").defaults["norm_batch"] == 32


def test_fedmcp_cka_is_unbiased_on_a_presets_batch() -> None:
    # Plain linear CKA of two unrelated 8-row batches in a 576-wide space is ~0.99 (so FedMCP's term would
    # change character with the batch a preset imposes); the debiased estimator is near 0 and still 1 for X, X.
    from training.algorithms.fedmcp import similarity

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 576, generator=gen), torch.randn(8, 576, generator=gen)
    assert float(similarity(x, y)) > 0.9
    assert abs(float(similarity(x, y, unbiased=True))) < 0.3
    assert float(similarity(x, x, unbiased=True)) == pytest.approx(1.0, rel=1e-4)
    assert float(similarity(x[:5], y[:5], unbiased=True)) == pytest.approx(_naive_unbiased_cka(x[:5], y[:5]),
                                                                           rel=1e-3, abs=1e-5)
    assert get_method("fedmcp").defaults["cka"] == "unbiased"
