"""The engine's limits are defined once (serving.engine.config.EngineConfig) and every edge derives from it."""

from __future__ import annotations

import argparse

import pytest

from serving.cli import add_serve_arguments, settings_from_args
from serving.engine import EngineConfig
from serving.engine.config import limit_bound, limit_default, limit_help
from serving.settings import ENGINE_LIMITS, ServeSettings
from serving.stack import stack_config

# what `fedmosaic serve` and FEDMOSAIC_SERVE_* have always offered: the flag and the server's default
SERVED = {"max_batch_size": ("--max-batch-size", None), "max_model_len": ("--max-model-len", None),
          "max_waiting": ("--max-waiting", 64), "max_prefill_tokens": ("--max-prefill-tokens", 512),
          "max_decode_skips": ("--max-decode-skips", 2), "max_lora_rank": ("--max-lora-rank", 16),
          "prefix_cache_slots": ("--prefix-cache-slots", 4), "route_state_cache": ("--route-state-cache", 4096),
          "request_timeout_s": ("--request-timeout", 600.0), "count_syncs": ("--count-syncs", False)}


def _flags() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {a.dest: a for a in serve._actions}


def test_every_engine_limit_is_one_flag_and_one_setting_with_its_help_and_bound() -> None:
    assert sorted(ENGINE_LIMITS) == sorted(SERVED)
    flags, fields = _flags(), ServeSettings.model_fields
    for name, (flag, default) in SERVED.items():
        assert fields[name].description.startswith(limit_help(name))
        assert fields[name].default == default
        assert flags[name].option_strings == [flag] and flags[name].default is None  # the environment wins
        assert flags[name].help.startswith(fields[name].description)
    assert limit_default("max_prefill_tokens") == fields["max_prefill_tokens"].default == 512
    with pytest.raises(ValueError, match=f"max_prefill_tokens must be >= {limit_bound('max_prefill_tokens')}"):
        EngineConfig(max_prefill_tokens=0)


def test_the_settings_engine_config_is_what_the_stack_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDMOSAIC_SERVE_MAX_DECODE_SKIPS", "0")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["serve", "--model", "tiny", "--max-waiting", "5",
                                                     "--request-timeout", "none", "--count-syncs"]))
    assert stack_config(settings).engine == settings.engine_config() == EngineConfig(
        max_waiting=5, max_decode_skips=0, request_timeout_s=None, count_syncs=True, auto_slots=True,
        auto_context=True)
