"""Injection into a Llama, PEFT round trips both ways, mixed batches, concat export, file errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from adapters import (
    AdaptedModel,
    AdapterError,
    LoraConfig,
    export_mixture,
    inject,
    load_adapter,
    save_adapter,
)
from models import LoadedModel

IDS = torch.tensor([[5, 17, 33, 8, 90, 4], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 8]])


def randomise(adapted: AdaptedModel, name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _, layer in adapted.adapter_layers(name):
        b = layer.adapters[name].lora_B
        with torch.no_grad():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
        layer.invalidate_cache()


def logits(adapted: AdaptedModel, names: tuple[str, ...], weights: list[list[float]]) -> torch.Tensor:
    with torch.no_grad(), adapted.context.use(names, weights):
        return adapted.model(IDS).logits


@pytest.fixture()
def adapted(tiny: LoadedModel) -> AdaptedModel:
    am = inject(tiny.model)
    am.add_adapter("global", LoraConfig(r=4), seed=1)
    am.add_adapter("local", LoraConfig(r=8, alpha=8), seed=2)
    randomise(am, "global", 3)
    randomise(am, "local", 4)
    return am


def test_remove_restores_the_model_exactly(tiny: LoadedModel) -> None:
    with torch.no_grad():
        before = tiny.model(IDS).logits
    state = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    am = inject(tiny.model)
    assert sorted({p.rpartition(".")[2] for p in am.layers}) == ["q_proj", "v_proj"]
    am.add_adapter("x", LoraConfig(), seed=0)
    randomise(am, "x", 0)
    am.merge("x")
    model = am.remove()
    assert set(model.state_dict()) == set(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before)


def test_injection_errors(tiny: LoadedModel) -> None:
    with pytest.raises(AdapterError, match="'nope_proj' match no nn.Linear"):
        inject(tiny.model, ["nope_proj"])
    am = inject(tiny.model)
    with pytest.raises(AdapterError, match="already has fedmosaic adapters"):
        inject(tiny.model)
    with pytest.raises(AdapterError, match="not injected"):
        am.add_adapter("k", LoraConfig(target_modules=("k_proj",)))
    with pytest.raises(AdapterError, match="invalid adapter name"):
        am.add_adapter("a.b", LoraConfig())


def test_mixed_batch_equals_separate_runs(adapted: AdaptedModel) -> None:
    names = ("global", "local")
    mixed = logits(adapted, names, [[1, 0], [0.4, 0.6], [0, 0]])
    torch.testing.assert_close(mixed[0], logits(adapted, ("global",), [[1.0]] * 3)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], logits(adapted, names, [[0.4, 0.6]] * 3)[1], atol=1e-5, rtol=1e-5)
    with torch.no_grad(), adapted.context.base():
        base = adapted.model(IDS).logits
    torch.testing.assert_close(mixed[2], base[2], atol=1e-6, rtol=1e-6)


def test_saved_adapter_loads_in_peft_with_identical_output(adapted: AdaptedModel, tmp_path: Path) -> None:
    ours = logits(adapted, ("local",), [[1.0]] * 3)
    save_adapter(adapted, "local", tmp_path / "local")
    config = json.loads((tmp_path / "local" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    model = adapted.remove()
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / "local"))
    with torch.no_grad():
        theirs = peft_model(IDS).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_peft_saved_adapter_loads_here_with_identical_output(tiny: LoadedModel, tmp_path: Path) -> None:
    torch.manual_seed(0)
    peft_model = get_peft_model(
        tiny.model, PeftLoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(IDS).logits
    peft_model.save_pretrained(str(tmp_path / "p"))
    model = peft_model.unload()
    am = inject(model)
    load_adapter(am, tmp_path / "p", "p")
    ours = logits(am, ("p",), [[1.0]] * 3)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_our_round_trip_and_replace(adapted: AdaptedModel, tmp_path: Path) -> None:
    before = logits(adapted, ("global",), [[1.0]] * 3)
    save_adapter(adapted, "global", tmp_path / "g")
    load_adapter(adapted, tmp_path / "g", "copy")
    torch.testing.assert_close(logits(adapted, ("copy",), [[1.0]] * 3), before)
    with pytest.raises(AdapterError, match="already loaded"):
        load_adapter(adapted, tmp_path / "g", "copy")
    load_adapter(adapted, tmp_path / "g", "copy", replace=True)


def test_concat_export_equals_weighted_sum_and_loads_in_peft(adapted: AdaptedModel, tmp_path: Path) -> None:
    a = 0.3
    mixed = logits(adapted, ("global", "local"), [[1 - a, a]] * 3)
    export_mixture(adapted, [("global", 1 - a), ("local", a)], tmp_path / "cat")
    config = json.loads((tmp_path / "cat" / "adapter_config.json").read_text())
    assert config["r"] == 12
    load_adapter(adapted, tmp_path / "cat", "cat")
    torch.testing.assert_close(logits(adapted, ("cat",), [[1.0]] * 3), mixed, atol=1e-5, rtol=1e-5)
    model = adapted.remove()
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / "cat"))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(IDS).logits, mixed, atol=1e-5, rtol=1e-5)


def _corrupt(src: Path, dst: Path, edit_state=None, edit_config=None) -> Path:
    dst.mkdir()
    state = load_file(str(src / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    if edit_state:
        state = edit_state(state)
    if edit_config:
        edit_config(config)
    save_file(state, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_load_errors_name_the_problem(adapted: AdaptedModel, tmp_path: Path) -> None:
    good = save_adapter(adapted, "global", tmp_path / "good")
    first = sorted(load_file(str(good / "adapter_model.safetensors")))[0]

    def drop(s):
        return {k: v for k, v in s.items() if k != first}

    def extra(s):
        return {**s, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}

    def nan(s):
        s[first] = torch.full_like(s[first], float("nan"))
        return s

    def rank(s):
        return {k: (v[:2] if ".lora_A." in k else v[:, :2]).contiguous() for k, v in s.items()}

    cases = {
        "missing keys": dict(edit_state=drop),
        "unexpected keys": dict(edit_state=extra),
        "NaN or inf": dict(edit_state=nan),
        "expected": dict(edit_state=rank),
        "other base|trained on base model": dict(edit_config=lambda c: c.update(base_model_name_or_path="other/model")),
        "peft_type": dict(edit_config=lambda c: c.update(peft_type="IA3")),
        "use_dora": dict(edit_config=lambda c: c.update(use_dora=True)),
    }
    for i, (message, edits) in enumerate(cases.items()):
        bad = _corrupt(good, tmp_path / f"bad{i}", **edits)
        with pytest.raises(AdapterError, match=message):
            load_adapter(adapted, bad, f"bad{i}")
        assert f"bad{i}" not in adapted.adapter_names  # nothing half-loaded
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(adapted, tmp_path / "missing", "m")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "adapter_config.json").write_text("{not json")
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(AdapterError, match="not valid JSON"):
        load_adapter(adapted, tmp_path / "torn", "t")
    (tmp_path / "torn" / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    with pytest.raises(AdapterError, match="safetensors"):
        load_adapter(adapted, tmp_path / "torn", "t")


def test_generate_with_per_row_adapters_matches_single_rows(adapted: AdaptedModel, tiny: LoadedModel) -> None:
    from serving.beam import GenerationConfig, generate

    prompts = ["### Instruction:\nsort apple banana\n\n### Response:\n", "The capital of"]
    cfg = GenerationConfig(max_new_tokens=6, batch_size=2)
    names = ("global", "local")
    both = generate(adapted, tiny.model, tiny.tokenizer, prompts, names, [[1, 0], [0.5, 0.5]], cfg)
    one = generate(adapted, tiny.model, tiny.tokenizer, prompts[1:], names, [[0.5, 0.5]], cfg)
    assert both[1] == one[0]
    beams = generate(adapted, tiny.model, tiny.tokenizer, prompts, names, [[1, 0], [0.5, 0.5]],
                     GenerationConfig(max_new_tokens=4, num_beams=2))
    assert len(beams) == 2


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from adapters.io import atomic_write

    atomic_write(tmp_path, "a.json", lambda tmp: Path(tmp).write_text('{"v": 1}'))
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))

    def torn(tmp: str) -> None:
        Path(tmp).write_text('{"v": 2')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path, "a.json", torn)
    assert json.loads((tmp_path / "a.json").read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    atomic_write(tmp_path, "a.json", lambda tmp: Path(tmp).write_text('{"v": 3}'))
    assert json.loads((tmp_path / "a.json").read_text()) == {"v": 3} and len(synced) == 2  # the file and its folder
