"""The labelled-positions training forward equals transformers' full forward with ``labels``: the loss, the
final-layer states and the adapters' gradients, for the LM loss and for FedOA's, FedMCP's and FedAMoLE's
objectives (float32, several batch shapes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from adapters import LoraConfig
from models import tiny_llama
from training.algorithms import fedmcp, fedoa
from training.algorithms.fedamole import method as fedamole
from training.algorithms.fedamole.rsea import AMoLEConfig
from training.data import IGNORE, Example, collate
from training.local import lm_forward as lmf
from training.local import packing
from training.local.runtime import Runtime, TrainConfig
from training.local.train import lm_loss

TRAIN = TrainConfig(lora=LoraConfig(dropout=0.0))


def hf_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_loss: bool = True) -> lmf.LMOutput:
    """The reference: transformers' own forward with ``labels`` (logits and float32 softmax at every position)."""
    assert lmf.WEIGHT_KEY not in batch
    kwargs = {"labels": batch["labels"]} if with_loss else {}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                **kwargs)
    return lmf.LMOutput(out.loss if with_loss else None, out.hidden_states[-1])


def _examples(lengths: list[int], prompt: list[int], seed: int = 0) -> list[Example]:
    """Examples of the given lengths, the first ``prompt[i]`` tokens masked out of the loss."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(lengths, prompt, strict=True):
        ids = torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append(Example(tuple(ids), tuple([IGNORE] * p + ids[p:])))
    return out


def _runtime() -> Runtime:
    rt = Runtime(tiny_llama(), TRAIN)
    gen = torch.Generator().manual_seed(7)
    for i, name in enumerate(("global", "local", "received")):  # non-zero B: every adapter changes the forward
        state = rt.fresh(name, i)
        rt.set(name, {k: torch.randn(v.shape, generator=gen) * 0.3 if k.endswith("lora_B") else v
                      for k, v in state.items()})
    rt.model.eval()  # no dropout anywhere: two forwards are comparable
    return rt


def _loss_and_grads(rt: Runtime, run: Callable[[], torch.Tensor], params: list[torch.nn.Parameter]
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    loss = run()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _assert_same(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 0 for g in a[1])
    for ga, gb in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


SHAPES = [([9], [4]), ([5, 12, 7], [2, 9, 6]), ([16, 16], [1, 3]), ([3, 20, 11, 4], [2, 15, 0, 3])]


@pytest.mark.parametrize("lengths,prompt", SHAPES)
def test_lm_loss_states_and_gradients_equal_the_full_forward(lengths: list[int], prompt: list[int]) -> None:
    rt = _runtime()
    batch = collate(_examples(lengths, prompt), pad_id=rt.tokenizer.pad_token_id)
    rt.adapted.set_trainable(["global"])
    params = rt.adapted.parameters_of(["global"])
    w = torch.ones(len(lengths), 1)
    with rt.adapted.context.use(("global",), w, trainable=("global",)):
        ours = _loss_and_grads(rt, lambda: lm_loss(rt, batch, ("global",), w)[0], params)
        ref = _loss_and_grads(rt, lambda: hf_forward(rt.model, batch).loss, params)
        states = lmf.lm_forward(rt.model, batch, with_loss=False).hidden
        torch.testing.assert_close(states, hf_forward(rt.model, batch, with_loss=False).hidden)
    _assert_same(ours, ref)


def test_row_weights_give_the_weighted_token_sum() -> None:
    rt = _runtime()
    exs = _examples([6, 10, 8], [2, 4, 7])
    batch = collate(exs, pad_id=rt.tokenizer.pad_token_id)
    weight = torch.tensor([0.5, 2.0, 0.25])
    with torch.no_grad():
        got = lmf.lm_forward(rt.model, {**batch, lmf.WEIGHT_KEY: weight}).loss
        # each row alone: HF's mean over its labelled tokens, times its token count, times its weight
        pad = rt.tokenizer.pad_token_id
        expect = sum(float(hf_forward(rt.model, collate([e], pad_id=pad)).loss)
                     * sum(label != IGNORE for label in e.labels[1:]) * float(wt)
                     for e, wt in zip(exs, weight, strict=True))
    assert float(got) == pytest.approx(expect, rel=1e-5)


def test_a_model_outside_the_plain_head_list_takes_the_full_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime()
    batch = collate(_examples([5, 9], [2, 3]), pad_id=rt.tokenizer.pad_token_id)
    with torch.no_grad():
        fast = lmf.lm_forward(rt.model, batch)
        monkeypatch.setattr(packing, "PLAIN_HEAD", frozenset())
        full = lmf.lm_forward(rt.model, batch)
        ref = hf_forward(rt.model, batch)
    torch.testing.assert_close(full.loss, ref.loss)
    torch.testing.assert_close(fast.loss, ref.loss)
    torch.testing.assert_close(full.hidden, ref.hidden)


def _method_objective(rt: Runtime, method: str, batch: dict[str, torch.Tensor]
                      ) -> tuple[Callable[[], torch.Tensor], list[torch.nn.Parameter]]:
    rows = batch["input_ids"].shape[0]
    if method == "fedoa":
        loss_fn, names, w = fedoa.fedoa_loss(0.5, "l2"), ("local",), torch.ones(rows, 1)
        trainable = ("local",)
    else:
        loss_fn, names, w = fedmcp.fedmcp_loss(0.5, 5.0), ("global", "local"), torch.full((rows, 2), 0.5)
        trainable = ("global", "local")
    rt.adapted.set_trainable(trainable)

    def run() -> torch.Tensor:
        loss_fn.begin_step(rt, [batch], names, w[:1])
        with rt.adapted.context.use(names, w, trainable=trainable):
            return loss_fn(rt, batch, names, w)[0]

    return run, rt.adapted.parameters_of(trainable)


@pytest.mark.parametrize("method", ["fedoa", "fedmcp"])
@pytest.mark.parametrize("lengths,prompt", SHAPES[1:3])
def test_feature_objectives_equal_the_full_forward(method: str, lengths: list[int], prompt: list[int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime()
    batch = collate(_examples(lengths, prompt), pad_id=rt.tokenizer.pad_token_id)
    run, params = _method_objective(rt, method, batch)
    ours = _loss_and_grads(rt, run, params)
    monkeypatch.setattr(fedoa if method == "fedoa" else fedmcp, "lm_forward", hf_forward)
    ref = _loss_and_grads(rt, run, params)
    _assert_same(ours, ref)


def test_amole_objective_with_its_load_balance_loss_equals_the_full_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime()
    cfg = AMoLEConfig(num_experts=4, max_experts=3, expert_choices=2)
    fedamole.ensure_experts(rt, cfg, 0)
    assignment = {path: [0, 1, 2] for path in rt.adapted.layers}
    held = [f"expert_{j}" for j in range(3)]
    rt.adapted.set_trainable(held)
    projs = [layer.token_proj for layer in rt.adapted.layers.values() if layer.token_proj is not None]
    for p in projs:
        p.requires_grad_(True)
    batch = collate(_examples([5, 12, 7], [2, 9, 6]), pad_id=rt.tokenizer.pad_token_id)
    loss_fn = fedamole.amole_loss(cfg, assignment)
    params = rt.adapted.parameters_of(held) + projs

    def run() -> torch.Tensor:
        return loss_fn(rt, batch, (), torch.zeros(3, 0))[0]

    ours = _loss_and_grads(rt, run, params)
    monkeypatch.setattr(fedamole, "lm_forward", lambda model, b: hf_forward(model, b))
    ref = _loss_and_grads(rt, run, params)
    _assert_same(ours, ref)
