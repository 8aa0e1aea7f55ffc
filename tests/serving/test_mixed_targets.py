"""Serving adapters whose target sets and ranks differ: the union injected, each adapter where it has weights.

A PEFT ``all-linear`` adapter made by PEFT loads through the server's stack (``build_stack``, its pool) and
gives PeftModel's logits on the same base, in the HF forward, the HF runner and the fused runner
(float32, max abs difference < 1e-4; measured about 1.5e-6). Adapters of different targets and ranks
mixed per row in both runners equal a naive reference that merges each row's adapters into a plain
copy of the model. An adapter loaded at runtime whose targets reach beyond the injected union is refused
with the modules named; ``--target-modules all-linear`` makes room for it up front. FedAMoLE experts on
every Linear route per token beside plain rows of other targets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from adapters import LoraConfig, inject, save_adapter
from adapters.amole_io import load_amole, save_amole
from adapters.amole_layer import add_amole_experts
from adapters.amole_routing import AMoLERouting
from adapters.io import same_base
from models import LoadedModel, tiny_llama
from models.tiny import tiny_tokenizer
from serving.cli import add_serve_arguments, settings_from_args
from serving.engine.kv import SlotKV
from serving.engine.request import GenerationRequest
from serving.engine.runner.hf import HFRunner
from serving.engine.runner.inputs import DecodeRow, PrefillRow, RowAdapters
from serving.engine.runner.llama import LlamaRunner
from serving.engine.sampling import SamplingParams
from serving.errors import AdapterLoadFailed
from serving.stack import StackConfig, build_stack, stack_config
from tests.adapters.mixed import MIXED, merged_logits, mixed_adapters, states
from tests.adapters.test_targets import smollm2_shaped
from tests.serving.helpers import write_feddpa_run

TOL = 1e-4  # float32, against PEFT and against the naive loop
IDS = torch.tensor([[5, 17, 33, 8, 90, 4, 7, 61], [9, 10, 11, 12, 13, 14, 15, 16], [3, 4, 5, 6, 7, 8, 9, 10]])


def runners(loaded: LoadedModel, adapted: object) -> list[HFRunner | LlamaRunner]:
    c = loaded.model.config
    kv = [SlotKV(c.num_hidden_layers, 4, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, 32,
                 torch.float32, torch.device("cpu")) for _ in range(2)]
    return [HFRunner(loaded.model, adapted, kv[0], loaded.autocast),  # type: ignore[arg-type]
            LlamaRunner(loaded.model, adapted, kv[1], loaded.autocast, lora_capacity=4, lora_rank=8)]  # type: ignore[arg-type]


def decode_matches(runner: HFRunner | LlamaRunner, mixes: list[RowAdapters], reference: object,
                   steps: int = 2) -> None:
    """Prefill ``IDS`` then decode ``steps`` greedy tokens; every step's logits equal ``reference(ids)``'s last."""
    ids = IDS.clone()
    rows = [PrefillRow(i, tuple(ids[i].tolist()), 0, m) for i, m in enumerate(mixes)]
    if isinstance(runner, LlamaRunner):
        assert runner.supports([r.adapters for r in rows])  # the fused path really runs these adapters
    with torch.inference_mode():
        out = runner.prefill(rows).logits
    for step in range(steps + 1):
        want = reference(ids)[:, -1]  # type: ignore[operator]
        assert (out - want).abs().max().item() < TOL, (type(runner).__name__, step)
        if step == steps:
            return
        nxt = want.argmax(-1)
        drows = [DecodeRow(i, int(nxt[i]), ids.shape[1], m) for i, m in enumerate(mixes)]
        ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
        with torch.inference_mode():
            out = runner.decode(drows).logits


def peft_all_linear(base: torch.nn.Module, folder: Path, rank: int = 8) -> PeftModel:
    """An all-linear PEFT adapter on ``base`` with random non-zero B, saved to ``folder``."""
    peft = get_peft_model(base, PeftLoraConfig(r=rank, lora_alpha=16, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft.save_pretrained(str(folder))
    return peft.eval()


@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
def test_a_peft_all_linear_adapter_serves_with_peft_logits(tmp_path: Path, shape: str) -> None:
    base = tiny_llama().model if shape == "tiny" else smollm2_shaped(layers=3)
    base.save_pretrained(str(tmp_path / "base"))
    tiny_tokenizer().save_pretrained(str(tmp_path / "base"))
    peft = peft_all_linear(base, tmp_path / "adapter")
    with torch.no_grad():
        want = peft(IDS).logits
    stack = build_stack(StackConfig(model=str(tmp_path / "base"), dtype="float32", device="cpu",
                                    adapters=(f"downloaded={tmp_path / 'adapter'}",), check_base=False))
    assert len(stack.adapted.layers) == 7 * base.config.num_hidden_layers  # every Linear but lm_head
    name = stack.pool.acquire(["downloaded"]).names[0]
    with torch.no_grad(), stack.adapted.context.uniform((name,), (1.0,)):
        assert (stack.loaded.model(IDS).logits - want).abs().max().item() < TOL
    for runner in runners(stack.loaded, stack.adapted):
        decode_matches(runner, [RowAdapters((name,), (1.0,))] * 3, lambda ids: peft(ids).logits, steps=1)


def test_mixed_targets_and_ranks_in_both_runners_equal_the_naive_loop(tiny: LoadedModel) -> None:
    adapted = mixed_adapters(tiny.model)
    rows = [{"qv": 0.7, "all": 0.3}, {"all": 1.0, "mlp1": 0.5}, {"mlp1": 1.0, "qv": -0.4}]
    mixes = [RowAdapters(tuple(r), tuple(r.values())) for r in rows]
    plain, held = tiny_llama().model, states(adapted)

    def reference(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return merged_logits(plain, held, ids, rows)

    for runner in runners(tiny, adapted):
        decode_matches(runner, mixes, reference)


def test_the_stack_injects_the_union_and_refuses_a_runtime_adapter_beyond_it(tmp_path: Path) -> None:
    run = write_feddpa_run(tmp_path / "run", ["c0"])  # q_proj, v_proj
    peft_all_linear(tiny_llama().model, tmp_path / "wide", rank=2)
    narrow = build_stack(StackConfig(model="tiny", dtype="float32", device="cpu", run_dir=run, adapter_root=tmp_path))
    assert {p.rpartition(".")[2] for p in narrow.adapted.layers} == {"q_proj", "v_proj"}
    with pytest.raises(AdapterLoadFailed, match=r"include \['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
                                                r"'up_proj'\].*--target-modules all-linear"):
        narrow.pool.load("wide", tmp_path / "wide")
    both = build_stack(StackConfig(model="tiny", dtype="float32", device="cpu", run_dir=run, adapter_root=tmp_path,
                                   adapters=(f"wide={tmp_path / 'wide'}",)))
    assert len(both.adapted.layers) == 14 and "wide" in both.pool.names()
    ready = build_stack(StackConfig(model="tiny", dtype="float32", device="cpu", run_dir=run, adapter_root=tmp_path,
                                    target_modules="all-linear"))
    ready.pool.load("wide", tmp_path / "wide")  # room made up front: the runtime load fits
    lease = ready.pool.acquire(["global", "c0:local", "wide"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(prompt="Sort these words", sampling=params, adapter_names=lease.names,
                                adapter_weights=(0.5, 0.25, 0.25))
    assert len(ready.engine.generate([request])[0].token_ids) == 4


def test_amole_experts_on_every_linear_beside_plain_rows(tmp_path: Path) -> None:
    """A FedAMoLE model on all-linear routes its tokens as a direct loop does, in a batch with a q/v adapter."""
    config = LoraConfig(r=2, alpha=4.0, dropout=0.0, target_modules="all-linear")
    maker = inject(tiny_llama().model, "all-linear")
    add_amole_experts(maker, 3, config, seed=0)
    gen = torch.Generator().manual_seed(5)
    for layer in maker.layers.values():
        for adapter in layer.adapters.values():
            with torch.no_grad():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * 0.4)
    assignments = {"c0": {p: [0, 2] for p in maker.layers}}
    amole = tmp_path / "run" / "adapters" / "amole"
    save_amole(maker, amole, 3, assignments, top_k=1)
    (tmp_path / "run" / "run.json").write_text(json.dumps({"method": "fedamole", "model": "tiny",
                                                           "train": {"lora": config.asdict()}}))
    write_qv = mixed_adapters(tiny_llama().model, ("qv",))
    save_adapter(write_qv, "qv", tmp_path / "qv")
    stack = build_stack(StackConfig(model="tiny", dtype="float32", device="cpu", run_dir=tmp_path / "run",
                                    adapter_root=tmp_path, adapters=(f"qv={tmp_path / 'qv'}",)))
    assert len(stack.adapted.layers) == 14
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    route = stack.pool.acquire(["c0"]).route
    qv = stack.pool.acquire(["qv"]).names
    reqs = [GenerationRequest(prompt="Sort these words", sampling=params, route=route),
            GenerationRequest(prompt="Convert 5 km", sampling=params, adapter_names=qv, adapter_weights=(1.0,))]
    together = stack.engine.generate(reqs)
    # the references: a direct per-token AMoLE loop on a fresh all-linear model, and the q/v adapter merged
    tiny = tiny_llama()
    direct = inject(tiny.model, "all-linear")
    loaded_assign, top_k = load_amole(direct, amole)
    ids, out = tiny.tokenizer("Sort these words", add_special_tokens=False)["input_ids"], []
    for _ in range(5):
        routing = AMoLERouting(groups=(loaded_assign["c0"],), row_group=torch.tensor([0]), top_k=top_k)
        with torch.inference_mode(), direct.context.route_tokens(routing):
            out.append(int(tiny.model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    assert list(together[0].token_ids) == out
    qv_ids, qv_out = tiny.tokenizer("Convert 5 km", add_special_tokens=False)["input_ids"], []
    plain, held = tiny_llama().model, states(write_qv)
    for _ in range(5):
        with torch.no_grad():
            logits = merged_logits(plain, held, torch.tensor([qv_ids + qv_out]), [{"qv": 1.0}])
        qv_out.append(int(logits[0, -1].argmax()))
    assert list(together[1].token_ids) == qv_out and MIXED["qv"].target_modules == ("q_proj", "v_proj")


def test_serve_flags_and_the_base_model_check() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["serve", "--target-modules", "all-linear", "--no-check-base"]))
    assert settings.target_modules == "all-linear" and not settings.check_base
    assert stack_config(settings).target_modules == "all-linear"
    assert stack_config(settings_from_args(parser.parse_args(["serve", "--target-modules", "q_proj,o_proj"]))
                        ).target_modules == ("q_proj", "o_proj")
    with pytest.raises(SystemExit, match="target_modules.*not a valid regular expression"):
        settings_from_args(parser.parse_args(["serve", "--target-modules", "(q_proj"]))
    assert same_base("HuggingFaceTB/SmolLM2-135M-Instruct", "/models/smollm2-135m-instruct/")
    assert not same_base("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct")
