"""Serving under the CPU-side device check: the beam-search path and the engine on a pretend GPU.

The model sits on the pretend ``cuda:0`` of :class:`tests.devicecheck.ShadowDevice`; HF ``generate``
(beam search, the routed prefill of :func:`serving.beam.plan_weights`) must create nothing off the
model's device and answer as on the CPU. The continuous-batching engine is being rewritten for GPUs
(issue 22 part 3): its test is a strict xfail until it runs clean under the check, and then it must pass.
``fedmosaic batch``'s runner runs under the check too (issue 46; AMoLE's serving benchmark: tests/bench/serving).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters import LoraConfig, inject, save_adapter
from models import LoadedModel, tiny_llama
from serving.batch import BatchConfig, run_batch
from serving.beam import GenerationConfig, generate, generate_target
from serving.engine.sampling import SamplingParams
from serving.stack import Job, ServingStack, StackConfig, build_stack
from tests.devicecheck import ShadowDevice
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import preset
from training.simulation import SimConfig, run_federated

PROMPTS = ["### Instruction:\nSort: pear apple\n\n### Response:\n", "Capital of Peru?", "hi"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT folder with a non-zero B, so the adapter changes the answers."""
    adapted = inject(tiny_llama().model)
    adapted.add_adapter("x", LoraConfig(r=4), seed=0)
    gen = torch.Generator().manual_seed(1)
    for layer in adapted.layers.values():
        with torch.no_grad():
            layer.adapters["x"].lora_B.copy_(torch.randn(layer.adapters["x"].lora_B.shape, generator=gen))
    return save_adapter(adapted, "x", tmp_path_factory.mktemp("adapter") / "x")


def _loaded(shadow: ShadowDevice | None) -> LoadedModel:
    loaded = tiny_llama()
    if shadow is not None:
        shadow.move(loaded.model)
    return loaded


def test_beam_search_with_per_row_weights_runs_on_the_models_device() -> None:
    def run(shadow: ShadowDevice | None) -> list[str]:
        loaded = _loaded(shadow)
        adapted = inject(loaded.model)
        adapted.add_adapter("a", LoraConfig(r=4), seed=0)
        return generate(adapted, loaded.model, loaded.tokenizer, PROMPTS, ("a",), [[1.0], [0.5], [0.0]],
                        GenerationConfig(max_new_tokens=4, num_beams=2, batch_size=2))

    plain = run(None)
    with ShadowDevice() as shadow:
        assert run(shadow) == plain


def test_served_targets_decoded_by_beam_search_run_on_the_models_device(adapter_dir: Path) -> None:
    def run(shadow: ShadowDevice | None) -> list[str]:
        stack = build_stack(StackConfig(model="tiny", adapters=(f"x={adapter_dir}",)), loaded=_loaded(shadow))
        outs = generate_target(stack, "x", PROMPTS, GenerationConfig(max_new_tokens=4, num_beams=2))
        return [o.text for o in outs]

    plain = run(None)
    with ShadowDevice() as shadow:
        assert run(shadow) == plain


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A FedDPA-T run (with its embedding index) and a FedAMoLE run, trained on the CPU."""
    data = generate_suite(n_train=4, n_test=1, families=["sorting", "capitals"])
    out = {}
    for method, options in (("feddpa-t", {}), ("fedamole", {"num_experts": 2, "expert_choices": 2})):
        out[method] = tmp_path_factory.mktemp("runs") / method
        run_federated(method, data, tiny_llama(), out[method], SimConfig(RoundConfig(rounds=2)),
                      preset("tiny", max_steps=1), options, data_spec="generated", model_name="tiny")
    return out


def _answers(stack: ServingStack, targets: list[str]) -> list[tuple[str, dict[str, float]]]:
    jobs = [Job(target=t, prompt=p, sampling=SamplingParams(max_tokens=4, temperature=temp, seed=3))
            for t in targets for temp in (0.0, 0.8) for p in PROMPTS]
    answers = []
    for outcome in stack.run(jobs):
        result = outcome.result
        if outcome.error is not None or result is None or result.finish_reason == "error":
            raise RuntimeError(f"{outcome.job.target}: {outcome.error or (result and result.error)}")
        answers.append((result.text, outcome.weights()))
    return answers


@pytest.mark.parametrize("source", ["adapter", "feddpa-t", "fedamole"])
def test_the_engine_serves_cpu_trained_runs_on_the_models_device(source: str, adapter_dir: Path,
                                                                 runs: dict[str, Path]) -> None:
    def run(shadow: ShadowDevice | None) -> list[tuple[str, dict[str, float]]]:
        if source == "adapter":
            config = StackConfig(model="tiny", adapters=(f"x={adapter_dir}",))
            targets = ["x", "tiny"]
        else:
            config = StackConfig(model="tiny", run_dir=runs[source])
            targets = ["sorting", "capitals"] + (["global", "sorting:local"] if source == "feddpa-t" else [])
        return _answers(build_stack(config, loaded=_loaded(shadow)), targets)

    plain = run(None)
    with ShadowDevice() as shadow:
        pretend = run(shadow)
    assert [text for text, _ in pretend] == [text for text, _ in plain]
    for (_, got), (_, want) in zip(pretend, plain, strict=True):
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-5 for k in want)


def test_a_batch_file_is_answered_on_the_models_device(runs: dict[str, Path], tmp_path: Path) -> None:
    """``fedmosaic batch``'s runner (chat template, FedDPA routing, AMoLE-free run) on a pretend GPU."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": target, "messages": [{"role": "user", "content": p}], "max_tokens": 4,
                       "temperature": temp, "seed": 5}}
             for i, (target, p, temp) in enumerate([("sorting", PROMPTS[0], 0.0), ("capitals", PROMPTS[1], 0.8),
                                                    ("global", PROMPTS[2], 0.0)])]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    def run(shadow: ShadowDevice | None, name: str) -> list[dict]:
        stack = build_stack(StackConfig(model="tiny", run_dir=runs["feddpa-t"]), loaded=_loaded(shadow))
        summary = run_batch(stack, stack.loaded.tokenizer, source, tmp_path / name, BatchConfig(), progress=False)
        assert summary.succeeded == len(lines)
        rows = [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
        return [r["response"]["body"]["choices"][0]["message"]["content"] for r in rows]

    plain = run(None, "plain.jsonl")
    with ShadowDevice() as shadow:
        assert run(shadow, "pretend.jsonl") == plain
