"""Protocol, aggregation and CKA maths without a model: fast checks of the pure functions."""

from __future__ import annotations

import pytest
import torch

from training.algorithms import ALGORITHMS, get_method
from training.algorithms.fedit import FedAvgStrategy
from training.algorithms.terms.cka import linear_cka
from training.algorithms.terms.features import feature_distance, last_token, mean_pool
from training.federation.aggregate import aggregate_results, weighted_average
from training.local.train import PRESETS, TrainConfig, preset
from training.protocol import FitRes
from training.state import state_bytes


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen)  # (r, in), (out, r)
    return {"m.lora_A": a.to(dtype), "m.lora_B": b.to(dtype)}


def test_registry_holds_every_method_of_the_design() -> None:
    assert set(ALGORITHMS) >= {"local", "centralized", "fedit", "fedprox", "fedlora", "feddpa-f", "feddpa-t",
                               "fedoa", "fedmcp"}
    assert get_method("FedDPA-T").mixture_weight({"alpha": 0.3}) == 0.3  # inference lambda = alpha
    assert get_method("feddpa-f").mixture_weight({}) == 1.0
    assert get_method("fedit").mixture_weight({}) is None
    with pytest.raises(ValueError, match="unknown method"):
        get_method("fedsgd")


def test_fitres_bytes_is_the_tensor_payload() -> None:
    s = _state(0)
    assert FitRes("a", s, 3).bytes == state_bytes(s) == (8 * 16 + 16 * 8) * 4
    assert FitRes("a", {}, 3).bytes == 0


def test_averaging_identical_clients_is_the_identity_in_any_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        s = _state(1, dtype)
        out = weighted_average([s, s, s], [1.0, 2.0, 7.0])
        assert out is not None and all(out[k].dtype == dtype and torch.equal(out[k], s[k]) for k in s)


def test_weighting_by_num_examples_through_the_strategy() -> None:
    a, b = _state(2), _state(3)
    results = [FitRes("a", a, 10), FitRes("b", b, 30)]
    by_n = FedAvgStrategy(weighting="num_examples").aggregate(0, results, [], a)
    equal = FedAvgStrategy().aggregate(0, results, [], a)
    assert by_n is not None and equal is not None
    for k in a:
        assert torch.allclose(by_n[k], 0.25 * a[k] + 0.75 * b[k], atol=1e-6)
        assert torch.allclose(equal[k], 0.5 * a[k] + 0.5 * b[k], atol=1e-6)
    with pytest.raises(ValueError, match="weighting"):
        FedAvgStrategy(weighting="size")  # type: ignore[arg-type]


def test_aggregation_checks_shapes_and_weights_and_returns_none_for_nothing() -> None:
    a = _state(4)
    bad = {**a, "m.lora_A": torch.zeros(4, 16)}
    with pytest.raises(ValueError, match="shape"):
        weighted_average([a, bad], [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        weighted_average([a, a], [1, -1])
    with pytest.raises(ValueError, match="weights"):
        weighted_average([a, a], [1])
    assert aggregate_results([], "num_examples") is None
    assert FedAvgStrategy().aggregate(3, [], [("x", "boom")], a) is None  # Flower: nothing to aggregate


def test_cka_properties_beyond_the_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(9, 6, generator=gen), torch.randn(9, 4, generator=gen)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen))
    assert float(linear_cka(x, y)) == pytest.approx(float(linear_cka(y, x)), rel=1e-5)  # symmetric
    assert float(linear_cka(x @ q, y)) == pytest.approx(float(linear_cka(x, y)), rel=1e-4)  # rotation invariant
    assert 0.0 <= float(linear_cka(x, y)) <= 1.0
    x.requires_grad_(True)
    linear_cka(x, y).backward()  # FedMCP trains through it
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_feature_distances_and_pooling() -> None:
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    for kind in ("l2", "cosine", "pearson"):
        assert float(feature_distance(a, a, kind)) == pytest.approx(0.0, abs=1e-6)
    # FedOA's l2: the Frobenius norm of the (batch x hidden) difference, neither squared nor averaged
    assert float(feature_distance(a, b, "l2")) == pytest.approx(float(((a - b) ** 2).sum().sqrt()), rel=1e-6)
    with pytest.raises(ValueError, match="distance"):
        feature_distance(a, b, "kl")
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)  # (B, T, H)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert last_token(hidden, right)[:, 0].tolist() == [1.0, 7.0]
    assert last_token(hidden, left)[:, 0].tolist() == [3.0, 7.0]
    assert mean_pool(hidden, right)[:, 0].tolist() == [0.5, 5.5]  # padding excluded


def test_train_config_defaults_are_the_papers_and_presets_validate() -> None:
    cfg = TrainConfig()
    assert (cfg.lr, cfg.batch_size, cfg.cutoff_len, cfg.optimizer) == (3e-4, 32, 512, "adamw")
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == (8, 16, 0.05)
    assert cfg.max_grad_norm == 1.0  # the reference code's HF Trainer clips at 1.0
    # a budget is a fraction of the epochs (never a flat step cap) at a capped batch
    assert PRESETS["small"].batch_size == 8 and PRESETS["small"].max_steps is None
    assert 0 < PRESETS["small"].local_epochs < 1
    assert TrainConfig.from_dict(cfg.asdict()) == cfg
    assert preset("small", lr=1e-3, cutoff_len=None).lr == 1e-3
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="lion")
    with pytest.raises(ValueError, match="preset"):
        preset("huge")
