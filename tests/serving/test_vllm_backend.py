"""The optional vLLM backend without vLLM: backend choice, FedDPA weight quantisation, the exported
rank-concatenated adapters (numerically the (1 - a, a) mixture on the tiny model), and the AMoLE refusal."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from adapters import LoraConfig, inject, load_adapter, save_adapter
from models import tiny_llama
from routing.feddpa_options import FedDPAOptions
from serving.pool import RunInfo
from serving.stack import ServingStack, StackConfig, build_stack
from serving.vllm_backend import (
    BackendUnavailable,
    BackendUnsupported,
    LevelExporter,
    VLLMBackend,
    choose_backend,
    quantise,
    refuse_amole,
    unsupported_sampling,
    vllm_importable,
    vllm_rank,
)
from tests.serving.helpers import randomize

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])  # (1, T) token ids of the tiny vocabulary


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("vllm") / "run"
    adapted = inject(tiny_llama().model)
    for name, config, folder in (("g", LoraConfig(r=4, alpha=8.0), run / "adapters" / "global"),
                                 ("l", LoraConfig(r=2, alpha=6.0), run / "adapters" / "clients" / "c0" / "local")):
        adapted.add_adapter(name, config, seed=1)
        randomize(adapted, name, seed=7 + config.r)
        save_adapter(adapted, name, folder)
    (run / "run.json").write_text(json.dumps({"method": "feddpa-t", "model": "tiny", "inference_weight": 0.34}))
    return run


@pytest.fixture(scope="module")
def stack(run_dir: Path) -> ServingStack:
    return build_stack(StackConfig(model="tiny", run_dir=run_dir, feddpa=FedDPAOptions(routing="fixed")))


def test_backend_choice(caplog: pytest.LogCaptureFixture) -> None:
    assert choose_backend("torch") == "torch"
    with caplog.at_level(logging.INFO, logger="serving.vllm_backend"):
        assert choose_backend("auto", vllm_available=False) == "torch"
    assert "vllm is not installed" in caplog.text
    assert choose_backend("auto", vllm_available=True, cuda=False) == "torch"
    assert choose_backend("auto", vllm_available=True, cuda=True) == "vllm"
    assert choose_backend("vllm", vllm_available=True, cuda=True) == "vllm"
    with pytest.raises(BackendUnavailable, match="needs the vllm package"):
        choose_backend("vllm", vllm_available=False, cuda=True)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        choose_backend("vllm", vllm_available=True, cuda=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend("tensorrt")
    if not vllm_importable():  # this machine: the probe itself, no injected answers
        assert choose_backend("auto") == "torch"
        with pytest.raises(BackendUnavailable, match="vllm package"):
            choose_backend("vllm")


def test_quantisation_rule() -> None:
    assert quantise(0.34) == (3, pytest.approx(0.3))
    assert quantise(0.35) == (4, pytest.approx(0.4))  # a half step rounds up
    assert quantise(-0.2) == (0, 0.0) and quantise(1.7) == (10, 1.0)
    assert quantise(0.5, levels=3) == (1, 0.5) and quantise(0.74, levels=3) == (1, 0.5)
    with pytest.raises(ValueError, match="finite"):
        quantise(float("nan"))
    with pytest.raises(ValueError, match="levels"):
        quantise(0.5, levels=1)
    assert (vllm_rank(6), vllm_rank(16), vllm_rank(17)) == (8, 16, 32)
    with pytest.raises(BackendUnsupported, match="exceeds"):
        vllm_rank(600)


def test_level_adapter_equals_the_mixture(stack: ServingStack, run_dir: Path, tmp_path: Path) -> None:
    exporter = LevelExporter(stack, tmp_path / "levels", levels=11)
    level = exporter.get("c0", 0.34)  # the run's fixed weight rounds to the 0.3 level
    assert level.a == pytest.approx(0.3) and level.rank == 4 + 2 and level.path == tmp_path / "levels" / "c0" / "a03"
    assert exporter.get("c0", 0.26) is level  # same level: exported once
    check = inject(tiny_llama().model)
    load_adapter(check, run_dir / "adapters" / "global", "g")
    load_adapter(check, run_dir / "adapters" / "clients" / "c0" / "local", "l")
    load_adapter(check, level.path, "cat")
    with torch.inference_mode():
        with check.context.use(("g", "l"), torch.tensor([[0.7, 0.3]])):
            mixed = check.model(PROMPT).logits  # (1, T, V)
        with check.context.use(("cat",), torch.tensor([[1.0]])):
            cat = check.model(PROMPT).logits
        with check.context.use(("g",), torch.tensor([[1.0]])):
            alone = check.model(PROMPT).logits
    assert torch.allclose(mixed, cat, atol=1e-5)
    assert not torch.allclose(mixed, alone, atol=1e-3)  # the local adapter matters at this level
    top = exporter.get("c0", 1.0)
    assert top.path.name == "a10" and top.a == 1.0


def test_amole_runs_are_refused(stack: ServingStack, run_dir: Path, tmp_path: Path) -> None:
    amole = RunInfo(root=tmp_path, method="fedamole", base_model="tiny", inference_weight=None, global_name=None)
    with pytest.raises(BackendUnsupported, match="FedAMoLE run.*one LoRA per request.*--backend torch"):
        refuse_amole(amole)
    (tmp_path / "other" / "adapters" / "amole").mkdir(parents=True)  # an AMoLE export under another method name
    with pytest.raises(BackendUnsupported, match="FedAMoLE"):
        refuse_amole(dataclasses.replace(amole, root=tmp_path / "other", method="custom"))
    with pytest.raises(BackendUnsupported, match="FedAMoLE"):  # before anything needs vllm
        VLLMBackend(dataclasses.replace(stack, run_info=amole), tmp_path / "levels")
    refuse_amole(stack.run_info)  # a FedDPA run is servable
    if not vllm_importable():
        with pytest.raises(BackendUnavailable, match="vllm package"):
            VLLMBackend(stack, tmp_path / "levels")


def test_log_probabilities_are_refused_not_dropped() -> None:
    from serving.engine.sampling import SamplingParams

    assert unsupported_sampling(SamplingParams(presence_penalty=1.0, logit_bias=((3, 1.0),), min_tokens=2)) is None
    assert unsupported_sampling(SamplingParams(logprobs=0)) == "logprobs"
    assert unsupported_sampling(SamplingParams(prompt_logprobs=1)) == "prompt_logprobs"
