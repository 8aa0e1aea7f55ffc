"""Host work per engine step (issue 46): synchronisations counted on a pretend GPU, CPU time, the
profiler trace of ``fedmosaic serve --profile``, and the options that turn them on."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from models import tiny_llama
from serving.cli import add_serve_arguments, settings_from_args
from serving.engine import Engine, EngineConfig, StepReport
from serving.engine.host_work import StepProfiler, SyncCounter
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from tests.devicecheck import ShadowDevice


def test_host_reads_of_device_tensors_count_and_cpu_tensors_do_not() -> None:
    with ShadowDevice() as shadow:
        t = shadow.tensor(torch.arange(4.0))
        host = torch.empty(4)
        with SyncCounter() as counter:
            t.sum().item()
            t.tolist()
            t.cpu()
            host.copy_(t)
            t.to("cpu")
            bool(t[0] > -1)
            assert counter.syncs == 6
            t.to(torch.float64).sum()  # stays on the device: no wait
            host.sum().item()  # a CPU tensor: nothing to wait for
            host.tolist()
    assert counter.syncs == 6 and counter.seconds >= 0.0


def _requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=f"hello {i}", sampling=SamplingParams(max_tokens=4, temperature=0.7 * (i % 2),
                                                                           seed=i)) for i in range(n)]


def _run(rows: int, shadow: ShadowDevice | None) -> tuple[list[str], list[StepReport]]:
    loaded = tiny_llama()
    if shadow is not None:
        shadow.move(loaded.model)
    engine = Engine(loaded, None, EngineConfig(count_syncs=True))
    reports: list[StepReport] = []
    engine.step_observers.append(reports.append)
    return [r.text for r in engine.generate(_requests(rows))], reports


def test_engine_steps_report_their_synchronisations_on_a_pretend_gpu() -> None:
    with ShadowDevice() as shadow:
        one_text, one = _run(1, shadow)
    with ShadowDevice() as shadow:
        four_text, four = _run(4, shadow)
    assert all(r.syncs >= 1 and r.cpu_seconds > 0 for r in one + four)  # the sampled tokens are read back
    decode_one, decode_four = ({r.syncs for r in steps if r.kind == "decode"} for steps in (one, four))
    assert decode_one and decode_one == decode_four  # no per-row reads: four rows sync as often as one
    plain_text, plain = _run(4, None)
    assert four_text == plain_text and one_text == plain_text[:1]  # counting changes no answer
    assert all(r.syncs == 0 for r in plain)  # CPU tensors: nothing to wait for


def test_the_profiler_writes_a_trace_of_engine_steps(tmp_path: Path) -> None:
    engine = Engine(tiny_llama(), None, EngineConfig())
    profiler = StepProfiler(tmp_path / "trace", skip=1, steps=2)
    engine.step_observers.append(profiler)
    engine.generate(_requests(2))
    assert profiler.done
    traces = list((tmp_path / "trace").glob("*.pt.trace.json*"))
    assert len(traces) == 1 and "aten::" in traces[0].read_text()


def test_serve_options_turn_them_on(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["serve", "--model", "tiny", "--count-syncs",
                                                     "--profile", str(tmp_path)]))
    assert settings.count_syncs and settings.profile_dir == tmp_path
    plain = settings_from_args(parser.parse_args(["serve", "--model", "tiny"]))
    assert not plain.count_syncs and plain.profile_dir is None


@pytest.mark.parametrize("count", [False, True])
def test_metrics_record_cpu_time_and_synchronisations(count: bool) -> None:
    from serving.api.prometheus import Metrics

    metrics = Metrics()
    metrics.observe_step(StepReport(0.02, 0, 4, 0.015, 3 if count else 0, 0.004 if count else 0.0))
    text = metrics.render().decode()
    assert 'fedmosaic_engine_step_cpu_seconds_count{kind="decode"} 1.0' in text
    assert ('fedmosaic_engine_syncs_total{kind="decode"} 3.0' in text) == count
