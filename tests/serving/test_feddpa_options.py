"""FedDPA's serving options are defined once (routing.feddpa_options) and every edge derives from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from routing.base import RoutingError
from routing.feddpa_options import OPTION_NAMES, FedDPAOptions, option_default, option_help
from serving.cli import add_serve_arguments, settings_from_args
from serving.settings import ServeSettings
from serving.stack import stack_config


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser.add_subparsers())
    return parser


def test_every_option_is_one_flag_and_one_setting_with_its_default_and_help() -> None:
    serve = next(a for a in _serve_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {a.dest: a for a in serve._actions if a.dest.startswith("feddpa_")}
    assert sorted(flags) == sorted(f"feddpa_{n}" for n in OPTION_NAMES)
    fields = ServeSettings.model_fields
    for name in OPTION_NAMES:
        assert fields[f"feddpa_{name}"].default == option_default(name)
        assert fields[f"feddpa_{name}"].description == option_help(name)
        assert flags[f"feddpa_{name}"].help.startswith(option_help(name))
        assert flags[f"feddpa_{name}"].default is None  # a flag left out never overrides the environment


def test_flags_and_environment_reach_the_stack_config_as_one_options_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDMOSAIC_SERVE_FEDDPA_MODE", "knn")
    args = _serve_parser().parse_args(["serve", "--feddpa-similarity", "neg-l2", "--feddpa-samples", "3",
                                       "--feddpa-prefill", "once"])
    options = stack_config(settings_from_args(args)).feddpa
    assert options == FedDPAOptions(samples=3, mode="knn", similarity="neg_l2", prefill="once")
    assert (options.instance, options.rule) == (True, "paper")  # an ablation of the paper's rule: the paper's rule
    assert dataclasses.replace(options, weighting="fixed").instance is False


def test_bad_options_are_refused_with_the_option_named() -> None:
    with pytest.raises(RoutingError, match="calibrated FedDPA weighting"):
        FedDPAOptions(weighting="calibrated", variant="reference")
    with pytest.raises(RoutingError, match="mode"):
        FedDPAOptions(mode="nearest")  # type: ignore[arg-type]
    with pytest.raises(RoutingError, match="samples"):
        FedDPAOptions(samples=0)
    assert FedDPAOptions(routing="fixed", weighting=None, variant="reference").instance is False  # no rule to check
