"""The ``fedmosaic`` command: built-in subcommands, the plugin registry and its optional extras."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from fedmosaic import plugins
from fedmosaic.cli import build_parser, main

# Arguments each plugin's parser requires (parsing only: nothing runs).
REQUIRED = {"train": ["--method", "fedit", "--out", "x"], "eval": ["x"], "batch": ["-i", "a", "-o", "b"],
            "data": ["list"], "calibrate": ["x"], "export": ["x", "--client", "c", "--out", "o"]}


def test_cli_models_tiny_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "tiny", str(tmp_path / "tiny")]) == 0
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert main(["generate", "hello", "--model", str(tmp_path / "tiny"), "--adapter", "random:0.5",
                 "--max-new-tokens", "3", "--dtype", "float32"]) == 0
    with pytest.raises(SystemExit):
        main(["models", "prepare", "llama-70b"])


def test_every_registered_subcommand_is_built_from_its_module() -> None:
    parser = build_parser()  # every extra is installed here, so every plugin module is imported
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subcommands.choices) == {c.name for c in plugins.SUBCOMMANDS} | {"models", "generate"}
    for command in plugins.SUBCOMMANDS:
        assert all(plugins.missing_requirements(extra) == [] for extra in command.extras), command.name
        args = parser.parse_args([command.name, *REQUIRED.get(command.name, [])])
        assert getattr(args, "refusal", None) is None and args.func.__name__ == command.run, command.name


def test_declared_extras_are_the_projects() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert {e for c in plugins.SUBCOMMANDS for e in c.extras} <= set(project["project"]["optional-dependencies"])
    with pytest.raises(ValueError, match="no optional extra 'nonsense'"):
        plugins.missing_requirements("nonsense")


def test_a_missing_extra_names_what_to_install_when_the_subcommand_runs(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = plugins.missing_requirements
    monkeypatch.setattr(plugins, "missing_requirements",
                        lambda extra: ["scipy", "flwr"] if extra == "train" else real(extra))
    imported: list[str] = []
    import_module = importlib.import_module

    def record(name: str) -> object:
        imported.append(name)
        return import_module(name)

    monkeypatch.setattr(plugins.importlib, "import_module", record)
    parser = build_parser()
    assert "serving.cli" in imported and not {"training.cli", "fedmosaic.data_cli"} & set(imported)
    assert "train federated training in the in-process simulator (not installed here)" in " ".join(
        parser.format_help().split())
    with pytest.raises(SystemExit) as exc:
        main(["train", "--method", "fedit", "--out", "x"])  # refused before its arguments mean anything
    assert exc.value.code == ("fedmosaic train needs the optional extra 'train' (not installed: scipy, flwr); "
                              "install it with `pip install -e '.[train]'` in the repository (or `make venv`)")
    with pytest.raises(SystemExit) as exc:
        main(["data", "list"])
    assert str(exc.value.code).startswith("fedmosaic data needs the optional extra 'train'")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0 and "pip install -e '.[train]'" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--bogus"])  # an installed subcommand still refuses unknown arguments
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_two_missing_extras_are_named_together() -> None:
    command = plugins.Subcommand("quickstart", "m", "add", "run", ("train", "serve"), "")
    line = plugins.refusal(command, {"train": ["scipy"], "serve": ["fastapi", "uvicorn"]})
    assert line.startswith("fedmosaic quickstart needs the optional extras 'train' and 'serve' "
                           "(not installed: scipy, fastapi, uvicorn)")
    assert "pip install -e '.[train,serve]'" in line


def test_a_missing_module_of_ours_is_a_bug_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    ghost = plugins.Subcommand("ghost", "fedmosaic.no_such_cli", "add", "run", ("train",), "never there")
    monkeypatch.setattr(plugins, "SUBCOMMANDS", (*plugins.SUBCOMMANDS, ghost))
    with pytest.raises(ModuleNotFoundError, match="fedmosaic.no_such_cli"):
        build_parser()
