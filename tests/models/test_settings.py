"""The device and dtype settings: FEDMOSAIC_DEVICE, FEDMOSAIC_DTYPE, their checks and defaults, autocast."""

from __future__ import annotations

import warnings

import pytest
import torch

from models import compute_context, load_base_model, settings, tiny_llama


@pytest.fixture()
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch report one CUDA device (only the resolution logic runs; nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_resolve_device_forms_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDMOSAIC_DEVICE", raising=False)
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(settings.resolve_device(None)) == expected  # auto by default
    assert settings.resolve_device("cpu") == torch.device("cpu")
    assert settings.resolve_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setenv("FEDMOSAIC_DEVICE", "cpu")
    assert settings.default_device() == "cpu" and settings.resolve_device(None) == torch.device("cpu")
    monkeypatch.setenv("FEDMOSAIC_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"FEDMOSAIC_DEVICE must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        settings.resolve_device(None)
    for bad in ("gpu", "cuda0", "cuda:", "mps", "CPU", ""):
        with pytest.raises(ValueError, match="must be auto, cpu, cuda or cuda:N"):
            settings.resolve_device(bad)


def test_cuda_devices_resolve_with_an_index_and_missing_ones_are_named(
        monkeypatch: pytest.MonkeyPatch, one_gpu: None) -> None:
    del one_gpu
    monkeypatch.delenv("FEDMOSAIC_DEVICE", raising=False)
    assert str(settings.resolve_device("auto")) == "cuda:0"  # what run.json records
    assert str(settings.resolve_device("cuda")) == "cuda:0"
    assert str(settings.resolve_device("cuda:0")) == "cuda:0"
    with pytest.raises(ValueError, match=r"'cuda:7' does not exist: this machine has 1 CUDA device\(s\), cuda:0 to"):
        settings.resolve_device("cuda:7")


def test_cuda_without_a_gpu_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        settings.resolve_device("cuda")
    assert settings.resolve_device("auto") == torch.device("cpu")


def test_the_option_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FEDMOSAIC_DEVICE", "cuda:3")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        load_base_model("tiny")  # the environment applies when no device is given
    loaded = load_base_model("tiny", device="cpu")
    assert loaded.device == torch.device("cpu") and loaded.dtype == "float32"
    assert next(loaded.model.parameters()).device.type == "cpu"


def test_dtype_defaults_to_bf16_on_cuda_and_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDMOSAIC_DTYPE", raising=False)
    assert settings.default_dtype(torch.device("cuda", 0)) == "bfloat16"
    monkeypatch.setattr(settings, "cpu_has_native_bf16", lambda: True)
    assert settings.default_dtype(torch.device("cpu")) == settings.DEFAULT_DTYPE == "autocast-bf16"
    assert settings.default_dtype() == "autocast-bf16"
    monkeypatch.setattr(settings, "cpu_has_native_bf16", lambda: False)  # emulated bf16 is slower than fp32
    assert settings.default_dtype(torch.device("cpu")) == "float32"
    assert settings.default_dtype(torch.device("cuda", 0)) == "bfloat16"
    monkeypatch.setenv("FEDMOSAIC_DTYPE", "float32")
    assert settings.default_dtype(torch.device("cuda", 0)) == "float32"


def test_native_bf16_probe_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert settings.cpu_has_native_bf16()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not settings.cpu_has_native_bf16()
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert not settings.cpu_has_native_bf16()  # a torch without the probes: fp32, never emulated bf16


def test_autocast_follows_the_device_type() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU-only build warns that CUDA autocast is disabled
        ctx = compute_context("autocast-bf16", "cuda")
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
    assert compute_context("autocast-bf16").device == "cpu"  # type: ignore[attr-defined]
    loaded = tiny_llama(dtype="autocast-bf16")
    with loaded.autocast():
        assert torch.is_autocast_enabled("cpu")


def test_tiny_model_is_identical_whatever_its_dtype_or_device_request() -> None:
    a, b = tiny_llama(), tiny_llama(device="cpu", dtype="bfloat16")
    assert b.dtype == "bfloat16" and next(b.model.parameters()).dtype == torch.bfloat16
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x.to(torch.bfloat16), y), name
    with pytest.raises(ValueError, match="dtype must be one of"):
        tiny_llama(dtype="float16")  # type: ignore[arg-type]
