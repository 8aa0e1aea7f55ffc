"""Model families on the engine's runners against transformers' own forward, on tiny random models.

Each family is built from its transformers config class (hidden 64, 2 layers, 4 query heads over 2 KV
heads), with random weights, norms and biases. A base row and a LoRA row (the reference merges the adapter's
``scaling * B @ A`` into a copy of the weights: plain transformers, no code of ours) are prefilled together,
then decoded for a few steps; every logit is compared with the reference's forward over the whole sequence.
Tolerance: 1e-4 absolute in float32 (measured: at most 1.4e-5, summation order).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from adapters import AdaptedModel, LoraConfig, inject
from models import ModelError, load_base_model
from models.families import FAMILIES, FUSED_TYPES, TESTS, architecture_problem, table
from serving.engine.kv import SlotKV
from serving.engine.runner.hf import HFRunner
from serving.engine.runner.inputs import DecodeRow, PrefillRow, RowAdapters
from serving.engine.runner.llama import LlamaRunner, unsupported_reason
from tests.serving.helpers import randomize

TOLERANCE = 1e-4
MAX_LEN = 64
LORA = LoraConfig(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
SHAPE: dict[str, Any] = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "head_dim": 32},  # per-head q/k norms; head_dim != hidden / heads
    "gemma": {"model_type": "gemma", "head_dim": 16},
    "mistral-window": {"model_type": "mistral", "sliding_window": 6},  # below the sequence: the HF runner
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of ``name`` (CONFIGS), float32, eval mode, its norms and biases random too."""
    spec = {**SHAPE, **CONFIGS[name]}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.3 + (1.0 if p.dim() == 1 and "norm" in pname and name != "gemma" else 0.0)
                    if p.dim() == 1 else noise * 0.15)
            p.requires_grad_(False)
    return model


def merged_reference(model: torch.nn.Module, adapted: AdaptedModel, name: str) -> torch.nn.Module:
    """A copy of the base ``model`` with adapter ``name`` merged into its weights."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for path, layer in adapted.adapter_layers(name):
            a = layer.adapters[name]
            weight = cast(torch.Tensor, ref.get_submodule(path).weight)
            weight.add_(a.scaling * (a.lora_B @ a.lora_A))
    return ref


def setup(name: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, AdaptedModel]:
    """(model with adapter ``a`` injected, base reference, LoRA reference, adapter handle)."""
    model = build(name)
    base = copy.deepcopy(model)
    adapted = inject(model, LORA.target_modules)
    adapted.add_adapter("a", LORA, seed=0)
    randomize(adapted, "a", seed=1)
    return model, base, merged_reference(base, adapted, "a"), adapted


def slots(model: torch.nn.Module) -> SlotKV:
    c: Any = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return SlotKV(c.num_hidden_layers, 3, c.num_key_value_heads, head_dim, MAX_LEN, torch.float32,
                  torch.device("cpu"))


def worst_difference(name: str, fused: bool, steps: int = 4) -> float:
    """Largest |engine - transformers| logit over the prefill (every position) and ``steps`` decode steps."""
    model, base, lora, adapted = setup(name)
    kv = slots(model)
    runner = (LlamaRunner(model, adapted, kv, contextlib.nullcontext, lora_capacity=2, lora_rank=8) if fused
              else HFRunner(model, adapted, kv, contextlib.nullcontext))
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, int(SHAPE["vocab_size"]), (n,), generator=gen).tolist() for n in (9, 13)]
    refs, mixes = [base, lora], [RowAdapters(), RowAdapters(("a",), (1.0,))]
    worst = 0.0
    with torch.inference_mode():
        out = runner.prefill([PrefillRow(i, tuple(s), 0, m, all_logits=True)
                              for i, (s, m) in enumerate(zip(seqs, mixes, strict=True))])
        assert out.all_logits is not None
        for i, (s, ref) in enumerate(zip(seqs, refs, strict=True)):
            expected = ref(torch.tensor([s])).logits[0]
            got = out.all_logits[i]
            assert got is not None
            worst = max(worst, float((got - expected).abs().max()))
        logits = out.logits
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            rows = []
            for i, s in enumerate(seqs):
                s.append(nxt[i])
                rows.append(DecodeRow(i, nxt[i], len(s) - 1, mixes[i]))
            logits = runner.decode(rows).logits
            for i, (s, ref) in enumerate(zip(seqs, refs, strict=True)):
                worst = max(worst, float((logits[i] - ref(torch.tensor([s])).logits[0, -1]).abs().max()))
    return worst


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_fused_runner_gives_transformers_logits(name: str) -> None:
    model = build(name)
    assert unsupported_reason(model, MAX_LEN) is None  # the engine picks the fused runner
    assert worst_difference(name, fused=True) < TOLERANCE


@pytest.mark.parametrize("name", ["gemma", "mistral-window"])
def test_other_families_run_on_the_hf_runner_with_transformers_logits(name: str) -> None:
    reason = unsupported_reason(build(name), MAX_LEN)
    assert reason is not None and ("'gemma' is not one of" in reason or "sliding-window attention (6)" in reason)
    assert worst_difference(name, fused=False) < TOLERANCE


def test_the_sliding_window_hides_keys_beyond_it() -> None:
    # the 6-token window matters here: without it the HF runner's logits differ from transformers'
    model = build("mistral-window")
    runner = HFRunner(model, None, slots(model), contextlib.nullcontext)
    runner.window = None
    seq = list(range(3, 16))
    with torch.inference_mode():
        got = runner.prefill([PrefillRow(0, tuple(seq), 0, all_logits=True)]).all_logits
        expected = model(torch.tensor([seq])).logits[0]
    assert got is not None and got[0] is not None
    assert torch.allclose(got[0][:6], expected[:6], atol=TOLERANCE)
    assert float((got[0][6:] - expected[6:]).abs().max()) > 1e-2


def test_the_table_names_every_fused_family_and_its_test() -> None:
    fused = {f.model_type for f in FAMILIES if f.runner == "fused"}
    assert fused == set(FUSED_TYPES) and all(f.tested == TESTS for f in FAMILIES if f.runner == "fused")
    text = table()
    assert text.splitlines()[0].split() == ["family", "model_type", "runner", "tested"]
    assert "Qwen3" in text and "qwen3" in text


@pytest.mark.parametrize(("model_type", "extra", "problem"), [
    ("t5", {}, "'t5' is not a causal language model"),
    ("bert", {}, "'bert' is an encoder (BERT-style) model"),
    ("mamba", {}, "'mamba''s forward takes no"),
])
def test_an_unsupported_architecture_is_named_from_its_config(model_type: str, extra: dict, problem: str) -> None:
    assert problem in (architecture_problem(AutoConfig.for_model(model_type, **extra)) or "")


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not weights")  # never read: the check comes first
    return folder


def test_loading_refuses_before_reading_weights(tmp_path: Path) -> None:
    t5 = write_config(tmp_path / "t5", AutoConfig.for_model("t5").to_dict())
    with pytest.raises(ModelError, match="'t5' is not a causal language model.*Supported: fused engine: llama, "
                                         "mistral, qwen2, qwen3"):
        load_base_model(str(t5), device="cpu")
    unknown = write_config(tmp_path / "odd", {"model_type": "no-such-arch"})
    with pytest.raises(ModelError, match="'no-such-arch' is not an architecture transformers knows. Supported"):
        load_base_model(str(unknown), device="cpu")


def test_models_list_prints_the_families_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedmosaic.cli import main

    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert table() in out and "no prepared models" in out
