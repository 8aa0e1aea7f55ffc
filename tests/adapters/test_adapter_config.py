"""Issue 44 item 3: ``adapter_config.json`` fields are type-checked, the file's size and nesting bounded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adapters import AdapterError, LoraConfig, read_adapter_config

GOOD = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(("field", "value"), [
    ("r", None), ("r", 8.9), ("r", 8.0), ("r", "8"), ("r", True), ("r", 0), ("r", [8]),
    ("lora_alpha", [1]), ("lora_alpha", None), ("lora_alpha", "16"), ("lora_alpha", False), ("lora_alpha", 10 ** 400),
    ("lora_dropout", {"p": 0}), ("target_modules", 5), ("target_modules", ["q_proj", 3]),
    ("target_modules", [""]), ("use_rslora", "yes"),
])
def test_a_wrongly_typed_field_is_an_adapter_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(AdapterError, match=f"'{field}'"):
        LoraConfig.from_peft_dict({**GOOD, field: value})


def test_a_well_typed_config_reads_as_before() -> None:
    config = LoraConfig.from_peft_dict({**GOOD, "lora_alpha": 16.5, "use_rslora": True})
    assert (config.r, config.alpha, config.target_modules, config.use_rslora) == (4, 16.5, ("q_proj", "v_proj"), True)
    assert LoraConfig.from_peft_dict({"r": 2}).alpha == 8.0  # PEFT's defaults for absent fields


def write(folder: Path, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_bytes(data)
    return folder


@pytest.mark.parametrize(("data", "problem"), [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),  # a RecursionError in the JSON parser before
    (json.dumps({**GOOD, "x": [[[[[[[[[1]]]]]]]]]}).encode(), "nests deeper"),
    (json.dumps({**GOOD, "pad": "x" * (1 << 20)}).encode(), "larger than"),
    (b'{"r": 4, "note": "\xff"}', "not UTF-8"),
    (b'{"r": 4,', "not valid JSON"),
    (b"[1, 2]", "not a LoRA adapter config"),
])
def test_the_config_file_is_bounded_and_decoded_safely(tmp_path: Path, data: bytes, problem: str) -> None:
    with pytest.raises(AdapterError, match=problem):
        read_adapter_config(write(tmp_path / "a", data))


def test_a_config_file_reads_into_its_config_and_raw_fields(tmp_path: Path) -> None:
    config, raw = read_adapter_config(write(tmp_path / "a", json.dumps(GOOD).encode()))
    assert config.r == 4 and raw["lora_alpha"] == 8
