"""``TrainConfig.compile``: the decoder layers compiled (inductor) train what the eager layers train, a run
recorded eager (or before the field existed) resumes compiled, and bad settings are refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from fedmosaic.cli import main
from models import tiny_llama
from models.loaded import compile_decoder_layers
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import TrainConfig, preset
from training.simulation import SimConfig, run_federated

FAMILIES = ["sorting", "capitals"]
DATA = generate_suite(n_train=6, n_test=2, families=FAMILIES)
# LoRA dropout on: a compiled layer draws the eager layer's masks (adapters.dropout)
TRAIN = dataclasses.replace(preset("tiny"), lora=dataclasses.replace(preset("tiny").lora, dropout=0.1))


def _run(out: Path, rounds: int, train: TrainConfig, resume: bool = False) -> RunDir:
    run_federated("fedit", DATA, tiny_llama(), out, SimConfig(RoundConfig(rounds=rounds)), train, resume=resume,
                  data_spec="generated", data_options={"n_train": 6, "n_test": 2, "families": FAMILIES})
    return RunDir(out)


def test_an_eager_run_resumed_compiled_ends_where_the_eager_run_does(tmp_path: Path) -> None:
    straight = _run(tmp_path / "straight", 2, TRAIN)
    partial = _run(tmp_path / "partial", 1, TRAIN)
    config = json.loads(partial.run_json.read_text())
    del config["train"]["compile"]  # as run.json was written before the field existed
    partial.run_json.write_text(json.dumps(config))
    from torch._dynamo.utils import counters

    counters.clear()
    resumed = _run(tmp_path / "partial", 2, dataclasses.replace(TRAIN, compile="default"), resume=True)
    assert not counters["graph_break"], dict(counters["graph_break"])  # the layers traced whole
    a = load_file(str(straight.global_adapter / "adapter_model.safetensors"))
    b = load_file(str(resumed.global_adapter / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:  # float32: the same training up to the fused kernels' summation order
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-4)
    assert not torch.equal(a[next(iter(a))], torch.zeros_like(a[next(iter(a))]))


def test_settings_that_cannot_compile_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="compile must be None or a compile mode.*'fast'"):
        TrainConfig(compile="fast")
    with pytest.raises(ValueError, match=r"got \['default'\]"):  # not a string (a hand-edited config): no TypeError
        TrainConfig(compile=["default"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model.model.layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="default, max-autotune, got 'turbo'"):
        compile_decoder_layers(tiny_llama().model, "turbo")


def test_cuda_graphs_are_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """``reduce-overhead`` segfaulted in a compiled backward on an H200 (torch 2.11): a clear error instead."""
    with pytest.raises(ValueError, match="'reduce-overhead' is not offered for training: its CUDA graphs crashed"):
        TrainConfig(compile="reduce-overhead")
    model = tiny_llama().model
    with pytest.raises(ValueError, match="segmentation fault"):
        compile_decoder_layers(model, "reduce-overhead")
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in model.model.layers)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--compile", "reduce-overhead", "--data", "generated"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --compile: compile mode 'reduce-overhead' is not offered for training" in err
    assert "use one of default, max-autotune" in err


def test_every_layer_but_the_first_is_compiled() -> None:
    """The first layer's input needs no gradient: compiled, it would be a second variant of every graph."""
    model = tiny_llama().model
    layers = model.model.layers
    assert len(layers) > 1
    assert compile_decoder_layers(model) == len(layers) - 1
    assert getattr(layers[0], "_compiled_call_impl", None) is None
    assert all(layer._compiled_call_impl is not None for layer in list(layers)[1:])
    assert compile_decoder_layers(model) == 0  # already compiled: left as they are
