"""The ``fedmosaic`` command: built-in subcommands, the plugin registry and its optional extras."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmosaic.cli import main


def test_cli_models_tiny_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "tiny", str(tmp_path / "tiny")]) == 0
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert main(["generate", "hello", "--model", str(tmp_path / "tiny"), "--adapter", "random:0.5",
                 "--max-new-tokens", "3", "--dtype", "float32"]) == 0
    with pytest.raises(SystemExit):
        main(["models", "prepare", "llama-70b"])
