"""One weight row for every row (``AdapterContext.uniform``, the trainer's case): the contract's numbers,
gradients only where trainable, clear errors, and a trace with no graph break under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

from adapters import AdapterError
from adapters.context import AdapterWeights
from tests.adapters.test_layer_math import NAMES, make_layer, naive


@pytest.mark.parametrize("row", [(1.0, 0.0, 0.0, 0.0), (0.5, 0.0, -2.0, 0.0), (0.0, 0.0, 0.0, 0.0),
                                 (1.0, 1.0, 1.0, 1.0)])
@pytest.mark.parametrize("shape", [(4, 5, 12), (3, 12)])
def test_a_shared_row_equals_the_naive_loop_and_the_per_row_path(row: tuple[float, ...],
                                                                  shape: tuple[int, ...]) -> None:
    layer = make_layer()
    x = torch.randn(*shape)
    w = torch.tensor([row]).expand(shape[0], -1)
    with layer.context.uniform(NAMES, row):
        got = layer(x)
    with layer.context.use(NAMES, w):
        per_row = layer(x)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    expected = naive(layer, x3, NAMES, w)
    torch.testing.assert_close(got, expected if x.dim() == 3 else expected.squeeze(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, per_row, atol=1e-6, rtol=1e-6)


def test_only_trainable_adapters_get_gradients_equal_to_the_per_row_paths() -> None:
    layer = make_layer()
    x = torch.randn(4, 5, 12)
    row = (0.5, 1.0, 0.0, 0.25)
    grads = []
    for uniform in (True, False):
        for p in layer.parameters():
            p.grad = None
        ctx = (layer.context.uniform(NAMES, row, trainable=("a", "c")) if uniform
               else layer.context.use(NAMES, torch.tensor([row]).expand(4, -1), trainable=("a", "c")))
        with ctx:
            (layer(x) ** 2).sum().backward()
        assert layer.adapters["g"].lora_A.grad is None and layer.adapters["b"].lora_B.grad is None
        grads.append({n: layer.adapters[n].lora_B.grad.clone() for n in ("a", "c")})
    for n in ("a", "c"):
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-5)


def test_a_bad_row_is_refused_with_its_shape() -> None:
    layer = make_layer()
    with pytest.raises(AdapterError, match="2 columns for 4 adapters"), layer.context.uniform(NAMES, (1.0, 0.5)):
        pass
    with pytest.raises(AdapterError, match="NaN or inf"), layer.context.uniform(NAMES, (1.0, float("nan"), 0, 0)):
        pass
    for bad in ((1.0, 10 ** 400, 0, 0), (1.0, "half", 0, 0)):  # too large for a float; not a number
        with pytest.raises(AdapterError, match="must be 4 finite numbers"), layer.context.uniform(NAMES, bad):
            pass
    with pytest.raises(AdapterError, match=r"\(1, K\)"):
        AdapterWeights(names=("g",), weights=torch.ones(2, 1), row=(1.0,))


def test_a_compiled_layer_traces_a_shared_row_whole_and_agrees() -> None:
    layer = make_layer()
    layer.train()
    for a in layer.adapters.values():
        a.dropout = torch.nn.Identity()  # the same numbers with and without the compiler's RNG
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    x = torch.randn(2, 7, 12)
    out = {}
    for name, module in (("eager", layer), ("compiled", compiled)):
        for p in layer.parameters():
            p.grad = None
        with layer.context.uniform(NAMES, (1.0, 0.5, 0.0, 0.0), trainable=("a",)):
            y = module(x)
        (y ** 2).sum().backward()
        out[name] = (y.detach(), layer.adapters["a"].lora_A.grad.clone())
    torch.testing.assert_close(out["compiled"][0], out["eager"][0])
    torch.testing.assert_close(out["compiled"][1], out["eager"][1])
