"""The CPU-side device check (tests/devicecheck.py): what it catches, and adapters and routing under it.

Under :class:`~tests.devicecheck.ShadowDevice` the model pretends to live on ``cuda:0`` while everything
computes on the CPU, so each path below must (1) raise nothing, i.e. create no tensor off the model's
device and give no CPU generator a GPU tensor, and (2) compute what the same path computes on a plain CPU
model. The old ``add_adapter`` (a CPU generator drawing straight into the parameters, the
``RuntimeError`` of issue 22 on CUDA) is kept here as a test-local function to show the check sees it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from adapters import AdaptedModel, LoraAdapter, LoraConfig, inject
from adapters.amole_layer import add_amole_experts, token_proj_state
from adapters.amole_routing import AMoLERouting
from models import tiny_llama
from routing.embedding import embed_prompts
from tests.devicecheck import PRETEND, DeviceMismatch, ShadowDevice

IDS = [[5, 17, 33, 8], [9, 10, 11, 12], [3, 4, 5, 6]]


def _old_add_adapter(adapted: AdaptedModel, name: str, config: LoraConfig, seed: int) -> None:
    """``AdaptedModel.add_adapter`` before the device fix: the CPU generator drew into the layer's parameters."""
    generator = torch.Generator().manual_seed(seed)
    for layer in adapted.target_layers(config).values():
        adapter = LoraAdapter(layer.in_features, layer.out_features, config).to(layer.base_layer.weight.device)
        with torch.no_grad():
            nn.init.kaiming_uniform_(adapter.lora_A, a=math.sqrt(5), generator=generator)
        layer.adapters[name] = adapter


def _adapted(shadow: ShadowDevice | None, experts: bool = False) -> AdaptedModel:
    """The tiny model (on the pretend GPU with ``shadow``) with two seeded adapters whose B is non-zero."""
    model = tiny_llama().model
    if shadow is not None:
        shadow.move(model)
    adapted = inject(model)
    for i, name in enumerate(("a", "b")):
        adapted.add_adapter(name, LoraConfig(r=4, dropout=0.0), seed=i)
    if experts:
        add_amole_experts(adapted, num_experts=4, config=LoraConfig(r=4, dropout=0.0), seed=3)
    gen = torch.Generator().manual_seed(7)
    for layer in adapted.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():  # drawn on the CPU and copied, as every seeded tensor
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * 0.2)
    return adapted


def _on_both(fn, experts: bool = False):
    """``fn(adapted, shadow)`` on a CPU model, then on the pretend GPU; returns both results."""
    plain = fn(_adapted(None, experts), None)
    with ShadowDevice() as shadow:
        pretend = fn(_adapted(shadow, experts), shadow)
        assert shadow.calls > 100  # the model really ran inside the check
    return plain, pretend


def _ids(adapted: AdaptedModel) -> torch.Tensor:
    return torch.tensor(IDS, device=adapted.device)


def test_the_check_catches_mixing_a_cpu_generator_and_numpy() -> None:
    with ShadowDevice() as shadow:
        layer = shadow.move(nn.Linear(4, 2))
        assert layer.weight.device == PRETEND and layer.weight.is_cuda
        with pytest.raises(DeviceMismatch, match="cuda:0 and cpu"):
            layer(torch.ones(3, 4))  # an input left on the CPU
        out = layer(torch.ones(3, 4, device=layer.weight.device))  # an input that follows the model
        assert out.device == PRETEND and shadow.on_device(out)
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            nn.init.kaiming_uniform_(layer.weight, generator=torch.Generator())
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
            torch.randperm(4, generator=torch.Generator(), device=layer.weight.device)
        with pytest.raises(TypeError, match="numpy"):
            out.detach().numpy()
        assert out.detach().cpu().numpy().shape == (3, 2) and out.cpu().device.type == "cpu"
        assert layer.weight[torch.tensor([1])].device == PRETEND  # CUDA accepts CPU index tensors
        with torch.no_grad():
            layer.weight[0, 1:3] = torch.ones(2)  # a plain copy_ crosses devices
            with pytest.raises(DeviceMismatch):
                layer.weight[torch.tensor([0, 1])] = torch.ones(2, 4)  # index_put_ wants its values there
        assert (torch.ones(2) + torch.zeros(2)).device.type == "cpu"  # host-side work stays allowed
        moved = torch.zeros(2).to(PRETEND)
        assert shadow.on_device(moved) and not shadow.on_device(moved.cpu())


def test_it_catches_the_old_seeded_add_adapter_and_passes_the_fixed_one() -> None:
    with ShadowDevice() as shadow:
        adapted = inject(shadow.move(tiny_llama().model))
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            _old_add_adapter(adapted, "old", LoraConfig(), seed=0)
        adapted.add_adapter("new", LoraConfig(), seed=0)
        new = {k: v.cpu() for k, v in adapted.adapter_state("new").items()}
        assert all(shadow.on_device(p) for p in adapted.parameters_of(["new"]))
    cpu = inject(tiny_llama().model)
    cpu.add_adapter("new", LoraConfig(), seed=0)
    for key, value in cpu.adapter_state("new").items():
        assert torch.equal(value, new[key]), key  # the seed means the same adapter on every device


def test_seeded_amole_experts_and_projections_are_the_same_on_every_device() -> None:
    plain, pretend = _on_both(lambda adapted, _: {k: v.cpu() for k, v in token_proj_state(adapted).items()},
                              experts=True)
    assert plain.keys() == pretend.keys() and all(torch.equal(plain[k], pretend[k]) for k in plain)


def test_per_row_adapter_weights_forward_and_backward_stay_on_the_device() -> None:
    def run(adapted: AdaptedModel, shadow: ShadowDevice | None) -> tuple[torch.Tensor, ...]:
        ids = _ids(adapted)
        adapted.set_trainable(["a", "b"])
        weights = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]], device=adapted.device)  # dense + gathered
        with adapted.context.use(("a", "b"), weights, trainable=("b",)):
            out = adapted.model(input_ids=ids, labels=ids)
        out.loss.backward()
        with torch.no_grad(), adapted.context.use(("a", "b"), [[0.3, 0.7]] * 3):  # CPU weights: moved by the layers
            listed = adapted.model(input_ids=ids).logits
        grads = [p.grad for p in adapted.parameters_of(["b"])]
        assert all(g is not None for g in grads) and all(p.grad is None for p in adapted.parameters_of(["a"]))
        if shadow is not None:
            assert shadow.on_device(out.logits) and all(shadow.on_device(g) for g in grads)
        return out.logits.detach().cpu(), listed.cpu(), torch.cat([g.reshape(-1) for g in grads]).cpu()

    for plain, pretend in zip(*_on_both(run), strict=True):
        torch.testing.assert_close(pretend, plain)


def test_amole_layer_training_and_union_inference_stay_on_the_device() -> None:
    def run(adapted: AdaptedModel, shadow: ShadowDevice | None) -> tuple[torch.Tensor, ...]:
        ids = _ids(adapted)
        a = {p: (0, 2, 3) for p in adapted.layers}
        b = {p: (1, 2) for p in adapted.layers}
        routing = AMoLERouting(groups=(a, b), row_group=torch.tensor([0, 1, 0], device=adapted.device))
        assert routing.row_group.device.type == "cpu"  # host-side bookkeeping, whatever it was given on
        adapted.model.train()
        with adapted.context.route_tokens(routing):  # training: one group at a time, with gradients
            loss = adapted.model(input_ids=ids, labels=ids).loss
        adapted.model.eval()
        loss.backward()
        with torch.no_grad(), adapted.context.route_tokens(AMoLERouting(groups=(a, b), row_group=torch.tensor(
                [0, 1, -1], device="cpu"))):  # inference: both clients over the union of their experts
            union = adapted.model(input_ids=ids).logits
        proj = next(iter(adapted.layers.values())).token_proj
        assert proj is not None and proj.grad is not None
        return loss.detach().cpu(), union.cpu(), proj.grad.cpu()

    for plain, pretend in zip(*_on_both(run, experts=True), strict=True):
        torch.testing.assert_close(pretend, plain)


def test_routing_embeddings_leave_the_device_for_numpy() -> None:
    def run(adapted: AdaptedModel, shadow: ShadowDevice | None):
        del shadow
        tokenizer = tiny_llama().tokenizer
        prompts = ["### Instruction:\nSort: b a\n\n### Response:\n", "hello there", "x"]
        return embed_prompts(adapted.model, adapted, tokenizer, prompts, ("a",), batch_size=2)

    plain, pretend = _on_both(run)
    assert pretend.shape == plain.shape == (3, 64)
    assert abs(pretend - plain).max() < 1e-5


def test_a_cuda_generator_in_the_mode_draws_on_the_cpu_and_a_cpu_one_is_caught() -> None:
    real = torch.Generator
    with ShadowDevice() as shadow:
        gen = torch.Generator(device="cuda").manual_seed(1)
        assert gen.device == shadow.device
        drawn = torch.empty(4, device="cuda").exponential_(generator=gen)
        assert shadow.on_device(drawn)
        with pytest.raises(RuntimeError, match="generator"):
            torch.empty(4, device="cuda").exponential_(generator=torch.Generator().manual_seed(1))
    assert torch.Generator is real
    same = torch.empty(4).exponential_(generator=real().manual_seed(1))
    assert torch.equal(drawn, same)  # the pretend generator is a real CPU generator with the seed
