"""Target specs as PEFT's (names, a regex, all-linear), adapters of different targets and ranks mixed and
exported, and PEFT reading what we write (adapter_config.json with a regex or all-linear)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from adapters import AdapterError, LoraConfig, export_mixture, inject, save_adapter
from adapters.targets import parse_targets, select
from models import tiny_llama
from tests.adapters.mixed import MIXED, merged_logits, mixed_adapters, states

IDS = torch.tensor([[5, 17, 33, 8, 90, 4, 7], [9, 10, 11, 12, 13, 14, 15], [3, 4, 5, 6, 7, 8, 9]])


def smollm2_shaped(layers: int = 2) -> LlamaForCausalLM:
    """SmolLM2-135M's widths, heads and tied head, random weights (``layers`` decoder layers)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)).eval()


def test_command_line_specs() -> None:
    assert parse_targets("q_proj,v_proj") == ("q_proj", "v_proj")
    assert parse_targets(" q_proj, o_proj ") == ("q_proj", "o_proj")
    assert parse_targets("ALL-LINEAR") == "all-linear"
    assert parse_targets(r".*\.mlp\..*") == r".*\.mlp\..*"
    assert parse_targets("self_attn.q_proj") == ("self_attn.q_proj",)  # a dotted name is a name (suffix match)
    for bad, reason in (("", "needs module names"), ("q_proj|(", "not a valid regular expression")):
        with pytest.raises(AdapterError, match=reason):
            parse_targets(bad)
    with pytest.raises(AdapterError, match="must be module names"):
        LoraConfig(target_modules=("q_proj", ""))


@pytest.mark.parametrize("spec", ["all-linear", r".*layers\.1\..*(q|up)_proj", ["o_proj", "mlp.down_proj"]])
@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
def test_select_follows_peft_rules(spec: str | list[str], shape: str) -> None:
    """The modules we adapt for a spec are exactly those PEFT wraps in lora layers for it."""
    model = tiny_llama().model if shape == "tiny" else smollm2_shaped()
    ours = select(model, [spec if isinstance(spec, str) else tuple(spec)])
    peft = get_peft_model(model, PeftLoraConfig(r=2, target_modules=spec))
    wrapped = sorted(n.removeprefix("base_model.model.").removesuffix(".lora_A")
                     for n, _ in peft.named_modules() if n.endswith(".lora_A"))
    assert sorted(ours) == wrapped and "lm_head" not in ours


def test_union_injection_and_missing_targets_are_named() -> None:
    adapted = mixed_adapters(tiny_llama().model)
    assert len(adapted.layers) == 14  # all-linear: 7 Linear modules in each of the 2 layers, lm_head left out
    assert {p for p, _ in adapted.adapter_layers("mlp1")} == {"model.layers.1.mlp.gate_proj",
                                                               "model.layers.1.mlp.down_proj"}
    assert adapted.adapter_state("qv")["model.layers.0.self_attn.q_proj.lora_A"].shape == (4, 64)
    narrow = inject(tiny_llama().model)  # q_proj, v_proj
    with pytest.raises(AdapterError, match=r"include \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'up_proj'\]"):
        narrow.add_adapter("all", MIXED["all"])
    with pytest.raises(AdapterError, match="match no nn.Linear"):
        inject(tiny_llama().model, r"nothing\.here")


def test_mixed_targets_and_ranks_equal_the_naive_loop() -> None:
    """Per-row weights over adapters with different targets and ranks = each row's adapters merged by hand."""
    adapted = mixed_adapters(tiny_llama().model)
    rows = [{"qv": 0.7, "all": 0.3}, {"all": 1.0, "mlp1": 0.5}, {"mlp1": 1.0}]
    names = tuple(MIXED)
    weights = [[r.get(n, 0.0) for n in names] for r in rows]
    with torch.no_grad(), adapted.context.use(names, weights):
        ours = adapted.model(IDS).logits
    reference = merged_logits(tiny_llama().model, states(adapted), IDS, rows)
    assert (ours - reference).abs().max().item() < 1e-5
    assert (ours[2] - merged_logits(tiny_llama().model, {}, IDS[2:], [{}])[0]).abs().max().item() > 1e-3


def test_export_of_a_mixture_of_different_targets_loads_in_peft_with_the_same_logits(tmp_path: Path) -> None:
    adapted = mixed_adapters(tiny_llama().model)
    mixture = [("qv", 0.4), ("all", 0.35), ("mlp1", 0.25)]
    folder = export_mixture(adapted, mixture, tmp_path / "mix")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 + 2 + 6 and len(config["target_modules"]) == 14  # the union, as full paths
    with torch.no_grad(), adapted.context.use(tuple(n for n, _ in mixture), [[w for _, w in mixture]] * 3):
        ours = adapted.model(IDS).logits
    peft = PeftModel.from_pretrained(tiny_llama().model, str(folder)).eval()
    with torch.no_grad():
        assert (peft(IDS).logits - ours).abs().max().item() < 1e-5


@pytest.mark.parametrize("targets", ["all-linear", r".*\.layers\.0\.(self_attn\.k|mlp\.up)_proj"])
def test_peft_reads_our_regex_and_all_linear_adapters(tmp_path: Path, targets: str) -> None:
    adapted = inject(tiny_llama().model, targets)
    adapted.add_adapter("a", LoraConfig(r=3, alpha=5.0, dropout=0.1, target_modules=targets), seed=1)
    for _, layer in adapted.adapter_layers("a"):
        a = layer.adapters["a"]
        layer.set_weights("a", a.lora_A.detach().clone(), torch.randn(a.lora_B.shape) * 0.3)
    save_adapter(adapted, "a", tmp_path / "a")
    raw = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (raw["r"], raw["lora_alpha"], raw["lora_dropout"], raw["target_modules"]) == (3, 5.0, 0.1, targets)
    adapted.model.eval()
    with torch.no_grad(), adapted.context.uniform(("a",), (1.0,)):
        ours = adapted.model(IDS).logits
    peft = PeftModel.from_pretrained(tiny_llama().model, str(tmp_path / "a")).eval()
    with torch.no_grad():
        assert (peft(IDS).logits - ours).abs().max().item() < 1e-5
    assert LoraConfig.from_peft_dict(raw).target_modules == targets


def test_unsupported_peft_fields_are_refused() -> None:
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    assert LoraConfig.from_peft_dict(good).target_modules == "all-linear"
    for field, value in (("layers_to_transform", [0]), ("exclude_modules", ["o_proj"]),
                         ("modules_to_save", ["lm_head"])):
        with pytest.raises(AdapterError, match=field):
            LoraConfig.from_peft_dict({**good, field: value})
    with pytest.raises(AdapterError, match="not a valid regular expression"):
        LoraConfig.from_peft_dict({**good, "target_modules": "(q_proj"})
