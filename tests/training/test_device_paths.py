"""Training under the CPU-side device check: every method's client step and whole runs on a pretend GPU.

With the model on the pretend ``cuda:0`` of :class:`tests.devicecheck.ShadowDevice`, each client half
(batches, adapter weights, losses, regularisers, AMoLE routing and RSEA embeddings, the optimizer) must
create nothing off the model's device and upload CPU tensors, and compute what it computes on the CPU.
A simulated run on the pretend GPU records ``"device": "cuda:0"`` and ends with the CPU run's adapters,
FedDPA's embedding index and pFedSeq's server learners (which follow the run's device) included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adapters.rundir import RunDir
from models import LoadedModel, tiny_llama
from routing.cache import EmbeddingIndex
from tests.devicecheck import PRETEND, ShadowDevice
from training.algorithms import get_method
from training.algorithms.pfedseq.method import PFedSeqConfig, PFedSeqStrategy
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local import micro_batches
from training.local import train as local_train
from training.local.packing import packable
from training.local.runtime import Runtime, preset
from training.protocol import ClientContext, FitRes
from training.simulation import SimConfig, run_federated
from training.state import StateDict

DATA = generate_suite(n_train=6, n_test=1, families=["sorting", "capitals", "arithmetic", "sentiment"])
TRAIN = preset("tiny", max_steps=2)
# round 1 for the methods whose local step starts there; FedAMoLE's round 0 draws random assignments
CASES = {"fedit": ({}, 0), "fedprox": ({"mu": 0.5}, 0), "feddpa-t": ({}, 1), "fedoa": ({}, 1), "fedmcp": ({}, 0),
         "fedamole": ({"num_experts": 4, "max_experts": 3, "expert_choices": 2}, 0), "local": ({}, 0)}


@pytest.fixture(autouse=True, params=["packed", "grouped"])
def _one_grouping_policy(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The CPU may split a step into more forwards than a GPU (``training.local.micro_batches.forward_cost``) or
    pack it (``training.local.micro_batches.packs``), and LoRA dropout's masks follow the forwards: both runs
    here take one policy, so they compare like with like: packed rows, or the GPU's length-grouped
    batches (the policies themselves are tested in test_micro_batches.py and test_packing.py)."""
    monkeypatch.setattr(micro_batches, "forward_cost", lambda device: None)
    monkeypatch.setattr(local_train, "packs", lambda device, model: request.param == "packed" and packable(model))


def _fit(method: str, shadow: ShadowDevice | None,
         dtype: str = "float32") -> tuple[list[FitRes], dict[str, StateDict]]:
    """One round of ``method`` over the clients: the uploads and the clients' private adapters."""
    options, round_idx = CASES[method]
    rt = Runtime(_moved(shadow, dtype), TRAIN)
    m = get_method(method)
    opts = {**m.defaults, **options, "seed": 0}
    strategy, client = m.strategy(opts), m.client(opts)
    state = strategy.initial_state(rt)
    clients = DATA.client_ids
    ins = strategy.configure_round(round_idx, clients, state)
    private: dict[str, dict[str, StateDict]] = {c: {} for c in clients}
    results = [client.fit(ins[c], ClientContext(c, DATA.client(c), rt, private[c], 0)) for c in clients]
    strategy.aggregate(round_idx, results, [], state)
    return results, {c: p.get("local", {}) for c, p in private.items()}


@pytest.mark.parametrize("method", sorted(CASES))
def test_a_client_step_runs_on_the_models_device_and_uploads_cpu_tensors(method: str) -> None:
    plain, plain_private = _fit(method, None)
    with ShadowDevice() as shadow:
        pretend, pretend_private = _fit(method, shadow)
        for res in pretend:  # the wire format: CPU tensors, whatever device the client trained on
            assert all(v.device.type == "cpu" and not shadow.on_device(v) for v in res.state.values())
    for a, b in zip(plain, pretend, strict=True):
        assert a.state.keys() == b.state.keys() and a.metrics.keys() == b.metrics.keys()
        for key in a.state:
            torch.testing.assert_close(b.state[key], a.state[key], msg=key)
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], rel=1e-5)
    for client, local in plain_private.items():
        for key in local:
            torch.testing.assert_close(pretend_private[client][key], local[key], msg=key)


def _moved(shadow: ShadowDevice | None, dtype: str = "float32") -> LoadedModel:
    loaded = tiny_llama(dtype=dtype)  # type: ignore[arg-type]
    if shadow is not None:
        shadow.move(loaded.model)
    return loaded


@pytest.mark.parametrize("method", ["feddpa-t", "fedamole", "fedmcp"])
def test_a_bf16_model_on_the_pretend_gpu_trains_fp32_adapters(method: str) -> None:
    """bf16 weights are the default on CUDA: the fp32 adapters compute in the activations' dtype on every path
    (FedAMoLE's embedding pass once multiplied bf16 states by its fp32 token projection)."""
    with ShadowDevice() as shadow:
        results, _ = _fit(method, shadow, "bfloat16")
    for res in results:
        assert all(v.dtype == torch.float32 and bool(torch.isfinite(v).all()) for v in res.state.values())
        assert res.metrics["loss"] == res.metrics["loss"]  # not NaN


@pytest.mark.parametrize("method", sorted(CASES))
def test_every_client_step_trains_under_the_cpus_autocast_bf16_policy(method: str) -> None:
    """``autocast-bf16`` is the default on a CPU with native bf16: fp32 activations, frozen linear weights
    stored in bf16. Every forward of a client step must run under the policy (FedAMoLE's embedding pass
    once ran outside it, and every client of a SmolLM2 run failed on the dtype mismatch)."""
    results, _ = _fit(method, None, "autocast-bf16")
    plain, _ = _fit(method, None)
    for res, ref in zip(results, plain, strict=True):
        assert res.state.keys() == ref.state.keys()
        assert all(v.dtype == torch.float32 and bool(torch.isfinite(v).all()) for v in res.state.values())
        assert res.metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=0.05)  # bf16 matmuls, same step


def _run(method: str, out: Path, shadow: ShadowDevice | None, options: dict | None = None) -> RunDir:
    loaded = _moved(shadow)
    data = generate_suite(n_train=4, n_test=1, families=["sorting", "capitals"])
    run_federated(method, data, loaded, out, SimConfig(RoundConfig(rounds=2)), preset("tiny", max_steps=1), options,
                  data_spec="generated")
    return RunDir(out)


def _assert_same_files(plain: RunDir, pretend: RunDir) -> None:
    files = sorted((plain.root / "adapters").rglob("adapter_model.safetensors"))
    assert files
    for folder in files:
        a, b = load_file(str(folder)), load_file(str(pretend.root / folder.relative_to(plain.root)))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], msg=f"{folder}: {key}")


def test_a_feddpa_t_run_on_the_pretend_gpu_records_it_and_matches_the_cpu_run(tmp_path: Path) -> None:
    plain = _run("feddpa-t", tmp_path / "cpu", None)
    with ShadowDevice() as shadow:
        pretend = _run("feddpa-t", tmp_path / "gpu", shadow)
    assert json.loads(plain.run_json.read_text())["device"] == "cpu"
    assert json.loads(pretend.run_json.read_text())["device"] == str(PRETEND)
    _assert_same_files(plain, pretend)
    for client in plain.clients():  # FedDPA's instance index: embedded on the device, stored from the CPU
        a, b = EmbeddingIndex.load(plain.client_dir(client)), EmbeddingIndex.load(pretend.client_dir(client))
        assert np.abs(a.raw - b.raw).max() < 1e-5


def test_pfedseq_server_learners_follow_the_runs_device(tmp_path: Path) -> None:
    options = {"warmup": 0, "window": 2, "learner": "ssm", "chunk": 64}
    plain = _run("pfedseq", tmp_path / "cpu", None, options)
    with ShadowDevice() as shadow:
        pretend = _run("pfedseq", tmp_path / "gpu", shadow, options)
        strategy = PFedSeqStrategy(PFedSeqConfig.from_options(options), seed=0)
        strategy.initial_state(Runtime(tiny_llama(), TRAIN))
        assert strategy.device == torch.device("cpu")
        strategy.initial_state(Runtime(_moved(shadow), TRAIN))
        assert strategy.device == PRETEND  # auto: where the run's model is
    _assert_same_files(plain, pretend)
