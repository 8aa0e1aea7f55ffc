"""Engine defaults sized to the machine (issue 46): the arithmetic of :mod:`serving.engine.sizing`, the engine
and server built with it, and what ``/metrics`` and the start-up log say."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from models import tiny_llama
from serving.engine import Engine, EngineConfig
from serving.engine.sizing import MIN_CONTEXT, free_bytes, kv_bytes_per_position, plan_slots
from serving.settings import ServeSettings
from serving.stack import stack_config
from tests.serving.helpers import ready_client

SMOLLM2 = kv_bytes_per_position(30, 3, 64, torch.bfloat16)  # 30 layers, 3 kv heads of 64, bf16
LLAMA7B = kv_bytes_per_position(32, 32, 128, torch.bfloat16)


def test_bytes_per_position_are_k_and_v_of_every_layer() -> None:
    assert SMOLLM2 == 2 * 30 * 3 * 64 * 2 == 23_040
    assert LLAMA7B == 524_288  # 0.5 MiB a token: 2 GiB a 4096-token slot
    assert kv_bytes_per_position(2, 2, 16, torch.float32) == 2 * 2 * 2 * 16 * 4


def test_slots_fill_the_budget_beside_the_extra_rows() -> None:
    per_slot = LLAMA7B * 4096
    plan = plan_slots(50 * per_slot + per_slot // 2, LLAMA7B, 4096, extra_rows=5, max_slots=256)
    assert (plan.slots, plan.max_model_len) == (45, 4096)  # 50 rows fit, 5 are the scratch and prefix rows
    assert plan.kv_bytes == 50 * per_slot <= plan.budget_bytes
    # an H100's 0.8 x 62 GiB free after a SmolLM2 load: the cap, not the memory, decides
    assert plan_slots(int(0.8 * 62 * 2**30), SMOLLM2, 8192, 5, max_slots=256).slots == 256


def test_the_context_halves_until_min_slots_fit_and_one_slot_is_the_floor() -> None:
    per_slot = LLAMA7B * 4096
    plan = plan_slots(7 * per_slot, LLAMA7B, 4096, extra_rows=5, max_slots=256, min_slots=4)
    assert (plan.slots, plan.max_model_len) == (9, 2048)  # 2 slots at 4096; 14 rows at 2048
    tiny_budget = plan_slots(1000, LLAMA7B, 4096, extra_rows=5, max_slots=256)
    assert (tiny_budget.slots, tiny_budget.max_model_len) == (1, MIN_CONTEXT)  # never below one slot
    assert plan_slots(1000, LLAMA7B, 100, extra_rows=1, max_slots=8).max_model_len == 100  # never longer
    with pytest.raises(ValueError, match="per_position"):
        plan_slots(1000, 0, 100, extra_rows=1, max_slots=8)


def test_free_bytes_on_the_cpu_read_the_available_ram() -> None:
    free, source = free_bytes(torch.device("cpu"))
    assert free > 0 and source.startswith("cpu")
    if Path("/proc/meminfo").is_file():
        assert source == "cpu MemAvailable"


def test_an_automatic_engine_takes_the_models_context_and_states_its_plan(caplog: pytest.LogCaptureFixture) -> None:
    loaded = tiny_llama()
    with caplog.at_level(logging.INFO, logger="serving.engine"):
        engine = Engine(loaded, None, EngineConfig(auto_slots=True, auto_context=True))
    plan = engine.slot_plan
    assert plan is not None and engine.config.max_model_len == plan.max_model_len == 1024  # tiny's context
    assert engine.config.max_batch_size == plan.slots == engine.kv.num_slots and 1 <= plan.slots <= 64
    assert engine.kv.bytes_for(plan.max_model_len) == plan.kv_bytes <= plan.budget_bytes
    assert f"{plan.slots} slots x 1024 positions" in caplog.text
    given = Engine(loaded, None, EngineConfig(max_batch_size=3, max_model_len=100))
    assert (given.config.max_batch_size, given.config.max_model_len, given.slot_plan) == (3, 100, None)


def test_server_defaults_follow_the_machine_and_options_override(tmp_path: Path) -> None:
    engine = stack_config(ServeSettings(model="tiny")).engine
    assert engine.auto_slots and engine.auto_context
    engine = stack_config(ServeSettings(model="tiny", max_batch_size=3, max_model_len=512)).engine
    assert (engine.auto_slots, engine.auto_context, engine.max_batch_size, engine.max_model_len) == \
        (False, False, 3, 512)
    with ready_client(ServeSettings(model="tiny", max_model_len=512)) as client:
        text = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith(("fedmosaic_kv_slots", "fedmosaic_max_model_len", "fedmosaic_kv_cache_bytes"))}
    assert values["fedmosaic_max_model_len"] == 512 and 1 <= values["fedmosaic_kv_slots"] <= 64
    per_position = kv_bytes_per_position(2, 2, 16, torch.float32)  # the tiny model: 2 layers, 2 kv heads of 16
    assert values["fedmosaic_kv_cache_bytes"] == (values["fedmosaic_kv_slots"] + 5) * per_position * 512
