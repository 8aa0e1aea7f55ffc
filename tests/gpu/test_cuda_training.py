"""On a CUDA GPU (``make test-gpu``): training equals the CPU's. Skipped, with the reason, without one.

The tiny model in float32 on ``cuda:0`` and on the CPU, LoRA dropout off (masks come from each device's own
generator, so they differ by design): a seed gives the same adapters, and FedDPA-T and FedAMoLE rounds,
a FedDPA-T run of the simulator and a pFedSeq run (its server learners on the GPU) end with the CPU's
tensors up to float32 rounding. In bfloat16 (CUDA's default dtype) a FedDPA-T round moves the adapters
as the float32 CPU round does, within bf16 tolerance. Tolerances come from float32 against float64 runs
of the same rounds on the CPU (largest difference 1.6e-5 at values up to 0.5).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adapters import LoraConfig, inject
from adapters.amole_layer import add_amole_experts, token_proj_state
from fedmosaic.cli import main
from models import load_base_model
from training.algorithms import get_method
from training.algorithms.pfedseq.method import PFedSeqConfig, PFedSeqStrategy
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import Runtime, TrainConfig, preset
from training.protocol import ClientContext, FitIns, FitRes
from training.simulation import SimConfig, run_federated
from training.state import StateDict

pytestmark = pytest.mark.cuda

DATA = generate_suite(n_train=6, n_test=1, families=["sorting", "capitals", "arithmetic", "sentiment"])
TRAIN = preset("tiny", max_steps=2, lora=LoraConfig(dropout=0.0))
# 4 experts x 2 choices over 4 clients: each client holds exactly 2, so top-2 routing selects both and no
# discrete choice can flip on a float32 rounding difference between the devices
AMOLE = {"num_experts": 4, "max_experts": 3, "expert_choices": 2}
FP32 = {"atol": 1e-4, "rtol": 1e-3}
# FedAMoLE's experts: some elements' gradients are near AdamW's eps after cancellation, so the optimizer's
# division amplifies rounding. On an H100 the largest difference after two rounds was 2.1e-4 (an expert's
# lora_A, values up to 0.13; with clipping off or the load-balance term off alike), against 2.0e-5 for the
# CPU's float32 against float64 at the same element; the losses agree within 1e-6.
AMOLE_FP32 = {"atol": 5e-4, "rtol": 1e-3}


def _rounds(method: str, device: str, options: dict, rounds: int = 2,
            dtype: str = "float32") -> list[tuple[dict[str, FitIns], list[FitRes]]]:
    """``rounds`` rounds of ``method`` through the protocol on ``device``: per round (instructions, uploads)."""
    rt = Runtime(load_base_model("tiny", device=device, dtype=dtype), TRAIN)  # type: ignore[arg-type]
    assert rt.device.type == device
    m = get_method(method)
    opts = {**m.defaults, **options, "seed": 0}
    strategy, client = m.strategy(opts), m.client(opts)
    state = strategy.initial_state(rt)
    private: dict[str, dict[str, StateDict]] = {c: {} for c in DATA.client_ids}
    out = []
    for r in range(rounds):
        ins = strategy.configure_round(r, DATA.client_ids, state)
        results = [client.fit(ins[c], ClientContext(c, DATA.client(c), rt, private[c], 0)) for c in DATA.client_ids]
        out.append((ins, results))
        state = strategy.aggregate(r, results, [], state) or state
    return out


def _assert_rounds_close(gpu: list, cpu: list, **tol: float) -> None:
    for (_, got), (_, want) in zip(gpu, cpu, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.client_id == b.client_id and a.state.keys() == b.state.keys()
            for key in b.state:
                assert a.state[key].device.type == "cpu"  # uploads leave the GPU
                torch.testing.assert_close(a.state[key], b.state[key], msg=key, **tol)
            assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-4)


def test_a_seed_gives_the_same_adapters_and_projections_on_cpu_and_cuda() -> None:
    tensors = []
    for device in ("cpu", "cuda"):
        loaded = load_base_model("tiny", device=device)
        adapted = inject(loaded.model)
        adapted.add_adapter("a", LoraConfig(), seed=5)
        add_amole_experts(adapted, 3, LoraConfig(r=4), seed=2)
        assert adapted.layers[next(iter(adapted.layers))].adapters["a"].lora_A.device.type == device
        state = {**adapted.adapter_state("a"), **adapted.adapter_state("expert_1"), **token_proj_state(adapted)}
        fresh = Runtime(load_base_model("tiny", device=device), TRAIN).fresh("global", 11)
        tensors.append({**{k: v.cpu() for k, v in state.items()}, **{f"fresh.{k}": v for k, v in fresh.items()}})
    cpu, gpu = tensors
    assert cpu.keys() == gpu.keys()
    for key in cpu:
        assert torch.equal(cpu[key], gpu[key]), key  # drawn on the CPU, copied: bit for bit


def test_feddpa_t_rounds_on_cuda_equal_the_cpu_rounds() -> None:
    _assert_rounds_close(_rounds("feddpa-t", "cuda", {}), _rounds("feddpa-t", "cpu", {}), **FP32)


def test_fedamole_rounds_on_cuda_equal_the_cpu_rounds() -> None:
    gpu, cpu = _rounds("fedamole", "cuda", AMOLE), _rounds("fedamole", "cpu", AMOLE)
    for (ins_gpu, _), (ins_cpu, _) in zip(gpu, cpu, strict=True):  # the same expert assignments
        assert {c: i.config for c, i in ins_gpu.items()} == {c: i.config for c, i in ins_cpu.items()}
    _assert_rounds_close(gpu, cpu, **AMOLE_FP32)


def test_a_bf16_feddpa_t_round_on_cuda_moves_the_adapters_as_the_fp32_cpu_round() -> None:
    gpu, cpu = _rounds("feddpa-t", "cuda", {}, dtype="bfloat16"), _rounds("feddpa-t", "cpu", {})
    for (ins_g, got), (ins_c, want) in zip(gpu, cpu, strict=True):
        def update(ins: dict[str, FitIns], results: list[FitRes]) -> torch.Tensor:
            return torch.cat([(r.state[k].float() - ins[r.client_id].state[k].float()).reshape(-1)
                              for r in results for k in sorted(r.state)])
        a, b = update(ins_g, got), update(ins_c, want)
        # measured on the CPU (bf16 weights against fp32): cosine 0.996, relative error 0.09, loss 3e-5
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.97
        assert (a - b).norm() / b.norm() < 0.25
        for x, y in zip(got, want, strict=True):
            assert x.metrics["loss"] == pytest.approx(y.metrics["loss"], rel=2e-3)


def _run(method: str, device: str, out: Path, options: dict | None = None, train: TrainConfig = TRAIN) -> Path:
    data = generate_suite(n_train=4, n_test=1, families=["sorting", "capitals"])
    run_federated(method, data, load_base_model("tiny", device=device), out, SimConfig(RoundConfig(rounds=2)), train,
                  options, data_spec="generated")
    return out


def _assert_same_adapters(gpu: Path, cpu: Path) -> None:
    files = sorted(cpu.glob("adapters/**/adapter_model.safetensors"))
    assert files
    for path in files:
        want, got = load_file(str(path)), load_file(str(gpu / path.relative_to(cpu)))
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=f"{path}: {key}", **FP32)


def test_a_feddpa_t_run_on_cuda_records_its_device_and_ends_as_the_cpu_run(tmp_path: Path) -> None:
    gpu, cpu = _run("feddpa-t", "cuda", tmp_path / "gpu"), _run("feddpa-t", "cpu", tmp_path / "cpu")
    assert json.loads((gpu / "run.json").read_text())["device"] == "cuda:0"
    assert json.loads((cpu / "run.json").read_text())["device"] == "cpu"
    _assert_same_adapters(gpu, cpu)
    for client in ("sorting", "capitals"):  # FedDPA's instance index: embedded on the GPU, kept on the CPU
        a = np.load(gpu / "adapters" / "clients" / client / "embeddings.npy")
        b = np.load(cpu / "adapters" / "clients" / client / "embeddings.npy")
        assert np.abs(a - b).max() < 1e-4


def test_a_pfedseq_run_keeps_its_learners_on_the_gpu_and_ends_as_the_cpu_run(tmp_path: Path) -> None:
    options = {"warmup": 0, "window": 2, "learner": "ssm", "scan": "torch", "chunk": 256}
    strategy = PFedSeqStrategy(PFedSeqConfig.from_options(options), seed=0)
    strategy.initial_state(Runtime(load_base_model("tiny", device="cuda"), TRAIN))
    assert strategy.device == torch.device("cuda", 0)  # server_device auto follows the run's model
    gpu = _run("pfedseq", "cuda", tmp_path / "gpu", options)
    _assert_same_adapters(gpu, _run("pfedseq", "cpu", tmp_path / "cpu", options))
    assert json.loads((gpu / "run.json").read_text())["device"] == "cuda:0"
    rows = [json.loads(line) for line in (gpu / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("aggregate") and row.get("calib_rms", 0.0) > 0 for row in rows)  # the learner ran


def test_fedmosaic_train_device_cuda_runs_a_feddpa_t_run(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    assert main(["train", "--method", "feddpa-t", "--model", "tiny", "--preset", "tiny", "--rounds", "2",
                 "--data", "generated", "--n-train", "4", "--n-test", "1", "--families", "sorting,capitals",
                 "--device", "cuda", "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["device"] == "cuda:0"
    assert (out / "adapters" / "clients" / "sorting" / "local" / "adapter_model.safetensors").is_file()


def test_compiled_layers_on_cuda_train_what_eager_layers_train_with_lora_dropout(tmp_path: Path) -> None:
    """Inductor's CUDA kernels with LoRA dropout on: the compiled layers draw the eager layers' masks from the
    GPU's generator (one seed, the same draws in the same order), so the two runs end with the same adapters."""
    from torch._dynamo.utils import counters

    train = dataclasses.replace(TRAIN, lora=LoraConfig(dropout=0.1))
    eager = _run("fedit", "cuda", tmp_path / "eager", train=train)
    counters.clear()
    compiled = _run("fedit", "cuda", tmp_path / "compiled", train=dataclasses.replace(train, compile="default"))
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_same_adapters(compiled, eager)
