"""Target resolution with a state-reading router through the engine, and the serve CLI's settings."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from adapters import inject
from models import LoadedModel
from routing import RoutingDecision
from routing.base import Pooling
from serving.cli import add_serve_arguments, settings_from_args
from serving.engine import Engine
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams
from serving.pool import AdapterPool
from serving.settings import ServeSettings
from serving.targets import TargetResolver
from tests.serving.helpers import write_adapter


class RecordingRouter:
    """A router reading the prompt state, as routing's FedDPA router does (a from the state norm)."""

    uses_state = True
    pooling: Pooling = "last"

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def __call__(self, client: str, hidden_state: torch.Tensor | None,
                 prompt_ids: Sequence[int] | None = None) -> RoutingDecision:
        assert hidden_state is not None
        self.states.append(hidden_state)
        a = 0.3
        weights = torch.tensor([1 - a, a], dtype=torch.float64)
        return RoutingDecision(("global", f"{client}:local"), weights, {"alpha": a})


def test_router_weights_reach_the_decode(tiny: LoadedModel, tmp_path: Path) -> None:
    write_adapter(tiny, tmp_path / "g", seed=1)
    write_adapter(tiny, tmp_path / "l", seed=2)
    adapted = inject(tiny.model)
    engine = Engine(tiny, adapted)
    pool = AdapterPool(adapted, root=tmp_path, model_lock=engine.model_lock)
    pool.load("global", "g")
    pool.load("c7:local", "l")
    router = RecordingRouter()
    resolver = TargetResolver("tiny", pool, router)
    assert resolver.models() == ["tiny", "global", "c7:local", "c7"]
    plan = resolver.resolve("c7")
    assert plan.mode == "feddpa" and plan.prefill_weights == (1.0, 0.0)
    lease = pool.acquire(plan.names)
    params = SamplingParams(max_tokens=4, temperature=0)
    result = engine.generate([GenerationRequest(prompt="Hello", sampling=params, adapter_names=lease.names,
                                                adapter_weights=plan.weights, prefill_weights=plan.prefill_weights,
                                                weight_fn=plan.weight_fn)])[0]
    lease.release()
    assert router.states[0].shape == (64,)
    assert result.adapter_weights == (0.7, 0.3) and result.route_info == {"alpha": 0.3}
    fixed = TargetResolver("tiny", pool, None, default_alpha=0.2).resolve("c7")
    assert fixed.weight_fn is None and fixed.weights == (0.8, 0.2)


def test_serve_arguments(tiny: LoadedModel, tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    for name in ("a", "b"):  # adapter sources are checked before anything loads
        write_adapter(tiny, tmp_path / name, seed=1)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    args = parser.parse_args(["serve", str(tmp_path / "run"), f"x={tmp_path}/a", str(tmp_path / "b"), "--model",
                              "tiny", "--api-key", "k", "--max-loras", "3", "--port", "9000"])
    settings = settings_from_args(args)
    assert settings.run_dir == tmp_path / "run" and settings.api_keys == ["k"] and settings.max_loras == 3
    assert settings.adapters == [f"x={tmp_path}/a", f"b={tmp_path / 'b'}"]
    assert settings.host == "127.0.0.1" and settings.port == 9000


def test_serves_matches_models_without_listing(tiny: LoadedModel, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``resolve`` accepts exactly the names ``models`` lists, and never builds that list (1,000-client runs)."""
    for name, seed in (("g", 1), ("l", 2), ("x", 3)):
        write_adapter(tiny, tmp_path / name, seed=seed)
    adapted = inject(tiny.model)
    pool = AdapterPool(adapted, root=tmp_path)
    resolver = TargetResolver("tiny", pool)
    names = ["tiny", "global", "c7", "c7:local", "extra", "c8", "nope", "c7:local:local", ""]
    pool.load("c7:local", "l")
    assert [n for n in names if resolver.serves(n)] == [n for n in names if n in resolver.models()] \
        == ["tiny", "c7:local"]  # no global adapter: c7 is not a FedDPA client
    pool.load("global", "g")
    pool.load("extra", "x")
    listed = resolver.models()
    assert listed == ["tiny", "c7:local", "global", "extra", "c7"]
    assert [n for n in names if resolver.serves(n)] == [n for n in names if n in listed]
    monkeypatch.setattr(pool, "names", lambda: pytest.fail("resolve listed every adapter"))
    assert resolver.resolve("c7").mode == "feddpa" and resolver.resolve("extra").mode == "adapter"
    assert resolver.resolve("tiny").mode == "base"


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "tiny", *argv])


def test_engine_limits_from_the_command_line() -> None:
    """The engine's fault and queue settings are options; the environment applies when one is not given."""
    settings = settings_from_args(_serve_args("--max-waiting", "5", "--max-prefill-tokens", "64",
                                              "--request-timeout", "none", "--shutdown-timeout", "2.5",
                                              "--no-exit-on-engine-failure"))
    assert (settings.max_waiting, settings.max_prefill_tokens, settings.request_timeout_s,
            settings.shutdown_timeout_s, settings.exit_on_engine_failure) == (5, 64, None, 2.5, False)
    assert settings_from_args(_serve_args("--request-timeout", "30")).request_timeout_s == 30.0
    assert settings_from_args(_serve_args()).request_timeout_s == 600.0
    assert settings_from_args(_serve_args("--max-lora-rank", "64")).max_lora_rank == 64


def test_max_lora_rank_reaches_the_fused_runners_slots() -> None:
    from serving.settings import ServeSettings
    from serving.stack import stack_config

    assert stack_config(ServeSettings(model="tiny", max_lora_rank=32)).engine.max_lora_rank == 32


@pytest.mark.parametrize(("argv", "named"), [(["--max-prefill-tokens", "0"], "max_prefill_tokens"),
                                             (["--request-timeout", "-1"], "request_timeout_s"),
                                             (["--max-lora-rank", "0"], "max_lora_rank")])
def test_invalid_engine_limits_exit_naming_the_setting(argv: list[str], named: str) -> None:
    with pytest.raises(SystemExit, match=f"invalid server settings: {named}"):
        settings_from_args(_serve_args(*argv))


def test_a_check_across_settings_exits_with_its_message_alone() -> None:
    with pytest.raises(SystemExit, match=r"invalid server settings: Value error, the calibrated FedDPA weighting"):
        settings_from_args(_serve_args("--feddpa-similarity", "pearson", "--feddpa-weighting", "calibrated"))


def test_request_timeout_refuses_words() -> None:
    with pytest.raises(SystemExit):
        _serve_args("--request-timeout", "soon")


def _run_on(tmp_path: Path, model: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"method": "feddpa-t", "model": model}))
    return run


def test_a_run_is_served_on_the_base_model_it_was_trained_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.json's model unless one is given; a different one given stops the command with one line."""
    run = _run_on(tmp_path, "tiny")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(["serve", str(run)])).model == "tiny"
    assert ServeSettings(run_dir=run).model == "tiny"
    with pytest.raises(SystemExit, match=r"trained on the base model 'tiny', not 'smollm2'; leave out --model"):
        settings_from_args(parser.parse_args(["serve", str(run), "--model", "smollm2"]))
    monkeypatch.setenv("FEDMOSAIC_SERVE_MODEL", "smollm2")
    with pytest.raises(SystemExit, match="trained on the base model 'tiny'"):
        settings_from_args(parser.parse_args(["serve", str(run)]))
    assert ServeSettings(run_dir=run, check_base=False).model == "smollm2"  # the operator's override


def test_a_loaded_models_name_is_the_one_that_serves_its_runs(tmp_path: Path) -> None:
    """A run written from a loaded model records ``loaded.name`` (``run_federated`` without a model name,
    the benches): that name must load the model again and pass the served run's base check."""
    from models import load_base_model

    loaded = load_base_model("tiny")
    run = _run_on(tmp_path, loaded.name)
    assert ServeSettings(run_dir=run, model="tiny").model == "tiny"
    again = load_base_model(ServeSettings(run_dir=run).model)
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), again.model.state_dict().values(),
                                                 strict=True))


def test_a_run_trained_on_a_model_folder_is_served_on_that_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    run = _run_on(tmp_path, str(folder))
    assert ServeSettings(run_dir=run).model == str(folder)
    assert ServeSettings(run_dir=run, model=f"{folder}/").model == f"{folder}/"  # the same folder, spelt otherwise
    with pytest.raises(ValidationError, match="trained on the base model"):
        ServeSettings(run_dir=run, model=str(tmp_path))
    (run / "run.json").write_text("{not json")
    with pytest.raises(ValidationError, match="cannot read"):
        ServeSettings(run_dir=run)
