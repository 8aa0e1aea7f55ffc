"""Static decisions, the RoutingDecision contract, the fixed router and the batch's weight matrix."""

from __future__ import annotations

import pytest
import torch

from adapters import AdapterError, weight_matrix
from routing import (
    FixedWeightRouter,
    RoutingDecision,
    RoutingError,
    WeightRouter,
    base_model,
    fixed_feddpa,
    mixture,
    single,
)


def test_single_base_and_fixed() -> None:
    assert single("global").names == ("global",) and single("global").weights.tolist() == [1.0]
    assert base_model().names == () and base_model().row(2).shape == (2, 0)
    d = fixed_feddpa(0.3, "bob")
    assert d.names == ("global", "bob:local") and d.info["alpha"] == 0.3
    torch.testing.assert_close(d.weights, torch.tensor([0.7, 0.3], dtype=torch.float64))
    router = FixedWeightRouter(0.3)
    assert isinstance(router, WeightRouter) and not router.uses_state
    assert router("bob", None).names == d.names and router("bob", None).weights.tolist() == d.weights.tolist()


def test_mixture_accepts_scales_and_per_token_weights() -> None:
    d = mixture(["a", "b"], [0.2, 1.5], known={"a", "b", "c"})
    assert d.row(3).shape == (3, 2) and d.weights.tolist() == pytest.approx([0.2, 1.5])
    per_token = mixture(["a", "b"], torch.rand(4, 2))
    assert per_token.per_token and per_token.weights.shape == (4, 2)
    assert mixture(["a"], [-1.0], allow_negative=True).weights.tolist() == [-1.0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: mixture([], []), "at least one adapter"),
        (lambda: mixture(["a", "b"], [1.0]), "2 names"),
        (lambda: mixture(["a", "a"], [1.0, 1.0]), "unique"),
        (lambda: mixture(["a", "b"], [1.0, float("inf")]), "finite; adapter 'b'"),
        (lambda: mixture(["a", "b"], [1.0, -0.5]), r"negative mixture weight for adapter\(s\) \['b'\]"),
        (lambda: mixture(["a", "zz"], [1.0, 1.0], known={"a"}), r"unknown adapter\(s\) \['zz'\]"),
        (lambda: mixture(["a"], torch.ones(3)), "K=1"),
        (lambda: mixture(["a"], ["x"]), "numbers"),  # type: ignore[list-item]
        (lambda: single(""), "non-empty"),
        (lambda: single("nope", known=("global",)), "unknown adapter"),
        (lambda: fixed_feddpa(1.2, "c"), "fixed FedDPA weight a"),
        (lambda: fixed_feddpa(float("nan"), "c"), "fixed FedDPA weight a"),
        (lambda: FixedWeightRouter(-0.5), "alpha"),
        (lambda: RoutingDecision(("a",), torch.ones(2)), "K=1"),
        (lambda: RoutingDecision(("a",), [1.0]), "torch.Tensor"),  # type: ignore[arg-type]
        (lambda: RoutingDecision(("a",), torch.tensor([float("nan")])), "NaN"),
        (lambda: mixture(["a"], torch.ones(2, 1)).row(), "per-token"),
    ],
)
def test_validation_errors_name_the_problem(call: object, message: str) -> None:
    with pytest.raises(RoutingError, match=message):
        call()  # type: ignore[operator]


def test_decision_is_immutable_and_renamable() -> None:
    info = {"a": 0.3}
    d = fixed_feddpa(0.3, "bob")
    with pytest.raises(AttributeError):
        d.names = ("x",)  # type: ignore[misc]
    with pytest.raises(TypeError):
        d.info["a"] = 1.0  # type: ignore[index]
    d2 = RoutingDecision(("g",), torch.ones(1), info)
    info["a"] = 9.0
    assert d2.info["a"] == 0.3
    r = d.renamed({"bob:local": "alice:local"})
    assert r.names == ("global", "alice:local") and r.as_dict()["info"]["alpha"] == 0.3


def test_the_weight_matrix_of_a_batch_of_decisions() -> None:
    decisions = [fixed_feddpa(0.25, "ann"), single("bob:local"), base_model(), fixed_feddpa(0.5, "bob")]
    names, w = weight_matrix([(d.names, d.weights.tolist()) for d in decisions])
    assert names == ("global", "ann:local", "bob:local")
    torch.testing.assert_close(w, torch.tensor([[0.75, 0.25, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0],
                                                [0.5, 0.0, 0.5]]))
    with pytest.raises(AdapterError, match="unique adapter names"):
        weight_matrix([(("a", "a"), (1.0, 1.0))])
