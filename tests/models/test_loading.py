"""Base models: the SmolLM2 cache (prepare once, detect partial/corrupt caches), local folders, tiny model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import models
from models import prepare, save_tiny_llama, tiny_llama


def _fake_cache(folder: Path) -> Path:
    save_tiny_llama(folder)
    prepare.write_manifest(folder, source="test")
    return folder


def test_check_cache_accepts_complete_and_names_each_defect(tmp_path: Path) -> None:
    folder = _fake_cache(tmp_path / "m")
    assert prepare.check_cache(folder, full=True) is None

    (folder / prepare.MANIFEST).rename(folder / "manifest.bak")
    assert "missing" in str(prepare.check_cache(folder))
    (folder / "manifest.bak").rename(folder / prepare.MANIFEST)

    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a torn write
    assert "bytes, manifest says" in str(prepare.check_cache(folder))

    flipped = bytearray(data)
    flipped[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(flipped))
    assert prepare.check_cache(folder) is None  # sizes alone cannot see it ...
    assert "SHA-256" in str(prepare.check_cache(folder, full=True))  # ... the full check does

    weights.write_bytes(b"\x00" * len(data))
    manifest = json.loads((folder / prepare.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == len(data)
    assert "corrupt" in str(prepare.check_cache(folder))


def test_load_local_folder_and_errors(tmp_path: Path) -> None:
    folder = save_tiny_llama(tmp_path / "tiny")
    loaded = models.load_base_model(str(folder), dtype="float32")
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert not loaded.model.training and loaded.tokenizer.pad_token is not None
    reference = tiny_llama()
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference.model(ids).logits)
    bf16 = models.load_base_model(str(folder), dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(models.ModelError, match="no config.json"):
        models.load_base_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        models.load_base_model(str(folder), dtype="float8")  # type: ignore[arg-type]


def test_dtype_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from models import settings

    monkeypatch.setenv("FEDMOSAIC_DTYPE", "float16")
    with pytest.raises(ValueError, match="FEDMOSAIC_DTYPE"):
        settings.default_dtype()
    monkeypatch.setenv("FEDMOSAIC_DTYPE", "float32")
    assert settings.default_dtype() == "float32"


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    """The real prepared SmolLM2 in the user's cache (prepared once, about 20 s, then reused)."""
    return models.prepare_smollm2()


@pytest.mark.slow
def test_prepare_is_idempotent_and_clean(smollm2_folder: Path) -> None:
    stamp = (smollm2_folder / "model.safetensors").stat().st_mtime_ns
    assert models.prepare_smollm2() == smollm2_folder
    assert (smollm2_folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["hidden_size"] == 576 and config["num_hidden_layers"] == 30
    assert prepare.check_cache(smollm2_folder, full=True) is None


@pytest.mark.slow
def test_partial_cache_is_rebuilt_not_used(smollm2_folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / prepare.SMOLLM2_DIRNAME
    shutil.copytree(smollm2_folder, copy)
    with (copy / "model.safetensors").open("r+b") as fh:
        fh.truncate(1000)
    path = models.resolve_model_path("smollm2", cache=tmp_path)
    assert prepare.check_cache(Path(path), full=True) is None
    assert os.path.getsize(Path(path) / "model.safetensors") > 100_000_000


@pytest.mark.slow
def test_smollm2_answers_a_simple_instruction_with_an_adapter(smollm2_folder: Path) -> None:
    from adapters import LoraConfig, inject
    from serving.beam import GenerationConfig, generate

    loaded = models.load_base_model("smollm2")
    adapted = inject(loaded.model)
    adapted.add_adapter("fresh", LoraConfig(), seed=0)  # B = 0: the base model's answer
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    (answer,) = generate(adapted, loaded.model, tok, [prompt], ("fresh",), [[1.0]],
                         GenerationConfig(max_new_tokens=16), autocast=loaded.autocast)
    assert "Paris" in answer


def test_autocast_bf16_stores_linear_weights_in_bf16_with_identical_numbers() -> None:
    """Stored in bf16 once, the weights give the forward and gradients autocast gave from float32 ones."""
    import torch

    from models import tiny_llama

    stored = tiny_llama(dtype="autocast-bf16")
    reference = tiny_llama(dtype="float32")  # the same seeded weights, float32, run under the same autocast
    linears = [m for m in stored.model.modules() if isinstance(m, torch.nn.Linear)]
    embed = stored.model.get_input_embeddings().weight
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears if m.weight is not embed)
    assert embed.dtype == torch.float32  # the residual stream starts in float32 (a tied head stays with it)
    assert all(p.dtype == torch.float32 for n, p in stored.model.named_parameters() if "norm" in n)
    ids = torch.randint(0, int(embed.shape[0]), (2, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for loaded in (stored, reference):
        x = loaded.model.get_input_embeddings()(ids).detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = loaded.model(inputs_embeds=x).logits
        logits.float().logsumexp(-1).sum().backward()
        grads.append((logits.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
