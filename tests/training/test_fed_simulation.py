"""The simulator on the tiny model: resume with private state, timeouts, per-round rows, sampling, embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adapters import read_adapter_folder
from adapters.rundir import RunDir
from models import tiny_llama
from routing.embedding import embed_prompts
from training.data import PromptConfig, generate_suite, prompt_texts, split_tasks
from training.federation.rounds import RoundConfig, select_clients
from training.local.runtime import Runtime, preset
from training.simulation import SimConfig, run_federated

FAMILIES = ["sorting", "capitals"]
DATA = generate_suite(n_train=5, n_test=1, families=FAMILIES)
TRAIN = preset("tiny")


def _run(method: str, out: Path, rounds: int, resume: bool = False, **sim: object) -> RunDir:
    run_federated(method, DATA, tiny_llama(), out, SimConfig(RoundConfig(rounds=rounds), **sim), TRAIN, resume=resume,
                  data_spec="generated", data_options={"n_train": 5, "n_test": 1, "families": FAMILIES})
    return RunDir(out)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


def _rows(run: RunDir) -> list[dict]:
    return [json.loads(x) for x in run.metrics.read_text().splitlines()]


def test_fedmcp_resume_after_round_one_equals_a_straight_two_round_run(tmp_path: Path) -> None:
    straight = _run("fedmcp", tmp_path / "straight", rounds=2)
    _run("fedmcp", tmp_path / "cut", rounds=1)
    resumed = _run("fedmcp", tmp_path / "cut", rounds=2, resume=True)
    a, b = _tensors(straight.global_adapter), _tensors(resumed.global_adapter)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for c in DATA.client_ids:  # the private adapters went through the checkpoint too
        la, lb = _tensors(straight.local_adapter(c)), _tensors(resumed.local_adapter(c))
        assert all(torch.equal(la[k], lb[k]) for k in la)
    assert resumed.read_config()["rounds"] == 2  # run.json follows the extended run
    per_client = [(x["round"], x["client"]) for x in _rows(resumed) if "client" in x]
    assert sorted(per_client) == sorted(set(per_client)) and len(per_client) == 2 * len(DATA.client_ids)
    assert [x["loss"] for x in _rows(resumed) if x.get("aggregate")] == \
           [x["loss"] for x in _rows(straight) if x.get("aggregate")]


def test_every_client_over_the_soft_timeout_leaves_the_global_unchanged(tmp_path: Path) -> None:
    run = _run("fedit", tmp_path / "t", rounds=1, client_timeout_s=0.0, embed=False)
    rows = _rows(run)
    assert {x["client"] for x in rows if x.get("status") == "failed"} == set(DATA.client_ids)
    failed = [x for x in rows if x.get("status") == "failed"]
    # one text for one cause (the train command groups failures by it); the measured time is the row's seconds
    assert {x["error"] for x in failed} == {"TimeoutError: ran past the client timeout of 0.0 s"}
    assert all(x["seconds"] > 0.0 for x in failed)
    agg = [x for x in rows if x.get("aggregate")]
    assert agg[0]["clients"] == 0 and agg[0]["failed"] == 2 and (run.round_dir(0) / "COMPLETE").is_file()
    init = Runtime(tiny_llama(), TRAIN)
    from training.algorithms import get_method

    fresh = get_method("fedit").strategy({"seed": 0}).initial_state(init)
    saved = load_file(str(run.round_dir(0) / "server.safetensors"))
    bad = [k for k in fresh if not torch.equal(fresh[k], saved[k])]
    assert not bad, (bad[:3], [float((fresh[k] - saved[k]).abs().max()) for k in bad[:3]])  # state kept
    summary = json.loads((run.root / "summary.json").read_text())
    assert len(summary["failures"]) == 2 and summary["empty_rounds"] == [0]


def test_the_train_command_names_each_failure_and_fails_when_a_round_trained_no_client(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedmosaic.cli import main  # the command a user runs

    argv = ["train", "--method", "fedit", "--data", "generated", "--n-train", "5", "--n-test", "1", "--families",
            ",".join(FAMILIES), "--rounds", "1", "--model", "tiny", "--preset", "tiny"]
    assert main([*argv, "--out", str(tmp_path / "late"), "--timeout", "0"]) == 1
    out, err = capsys.readouterr()
    assert "failures 2" in out and "2 failed (round 0; capitals, sorting): TimeoutError" in out
    assert "round(s) 0 aggregated no client" in err and "new --out" in err
    assert main([*argv, "--out", str(tmp_path / "ok")]) == 0
    out, err = capsys.readouterr()
    assert "failures 0" in out and "failed (" not in out and "aggregated no client" not in err


def test_round_rows_carry_bytes_and_duration_and_only_the_global_travels(tmp_path: Path) -> None:
    run = _run("feddpa-t", tmp_path / "d", rounds=2, embed=False)
    cfg = run.read_config()
    assert cfg["inference_weight"] == 0.5 and cfg["method"] == "feddpa-t" and cfg["seed"] == 0
    global_bytes = sum(t.numel() * t.element_size() for t in _tensors(run.global_adapter).values())
    rows = _rows(run)
    for x in rows:
        if x.get("status") == "ok":
            assert x["bytes_up"] == x["bytes_down"] == global_bytes and x["seconds"] >= 0
            assert np.isfinite(x["loss"]) and x["num_examples"] == 5
        if x.get("aggregate"):
            assert x["bytes_up"] == x["bytes_down"] == 2 * global_bytes and x["seconds"] > 0
    assert any("local_loss" in x for x in rows if x.get("round") == 1 and "client" in x)
    assert any("local_loss" in x for x in rows if x.get("round") == 0 and "client" in x)  # Alg. 2: from round 0
    local = _run("local", tmp_path / "l", rounds=1, embed=False)
    assert all(x["bytes_up"] == x["bytes_down"] == 0 for x in _rows(local) if "bytes_up" in x)


def test_client_sampling_is_deterministic_per_round() -> None:
    many = split_tasks(generate_suite(n_train=4, n_test=1, families=["sorting", "capitals", "date_format"]), 2)
    sim = RoundConfig(rounds=3, fraction=0.5, seed=7)
    rounds = [select_clients(many, sim, r) for r in range(3)]
    assert rounds == [select_clients(many, sim, r) for r in range(3)]
    assert all(len(r) == 3 for r in rounds) and len({tuple(r) for r in rounds}) > 1
    per_task = RoundConfig(rounds=1, sample_rate=0.5, seed=7)
    chosen = select_clients(many, per_task, 0)
    assert sorted({many.client(c).task for c in chosen}) == sorted(["sorting", "capitals", "date_format"])
    with pytest.raises(ValueError, match="fraction"):
        RoundConfig(fraction=0.0)


def test_saved_embeddings_are_the_global_adapters_last_token_states(tmp_path: Path) -> None:
    import faiss

    run = _run("feddpa-f", tmp_path / "e", rounds=1)
    rt = Runtime(tiny_llama(), TRAIN)
    _, state, _ = read_adapter_folder(run.global_adapter)
    rt.set("global", state)
    for c in DATA.clients:
        saved = np.load(run.embeddings(c.client_id))
        index = faiss.read_index(str(run.client_dir(c.client_id) / "embeddings.faiss"))
        assert saved.shape[0] == index.ntotal == len(c.train)
        prompts = prompt_texts(c.train[:2], rt.tokenizer, PromptConfig(TRAIN.prompt_style))
        again = embed_prompts(rt.model, rt.adapted, rt.tokenizer, prompts, ("global",), autocast=rt.loaded.autocast)
        assert np.allclose(saved[:2], again, atol=1e-4)
        sims, idx = index.search(again[:1] / np.linalg.norm(again[:1]), 1)
        assert idx[0, 0] == 0 and sims[0, 0] == pytest.approx(1.0, abs=1e-4)  # unit vectors, inner product


def test_a_second_writer_on_the_same_run_directory_is_refused(tmp_path: Path) -> None:
    from adapters.config import AdapterError

    run = RunDir(tmp_path / "busy")
    with run.lock("a test holding it"):
        with pytest.raises(AdapterError, match=r"being written by pid \d+ \(a test holding it\)"):
            _run("fedit", run.root, rounds=1)
        assert not run.run_json.exists()  # the refused writer touched nothing
    _run("fedit", run.root, rounds=1)  # released on exit: the run goes ahead
    assert (run.root / "summary.json").is_file()


def test_a_split_run_records_its_clients_and_evaluation_reloads_them(tmp_path: Path) -> None:
    from training.data import load_run_dataset

    run = _run("fedlora", tmp_path / "split", rounds=1, clients_per_task=2, embed=False)
    cfg = run.read_config()
    assert cfg["clients_per_task"] == 2
    reloaded = load_run_dataset(cfg)
    assert reloaded.client_ids == split_tasks(DATA, 2, seed=0).client_ids == [
        "sorting-0", "sorting-1", "capitals-0", "capitals-1"]
    assert all(run.local_adapter(c).is_dir() for c in reloaded.client_ids)  # what evaluation will serve
    assert reloaded.task_of("capitals-1") == "capitals" and reloaded.tests == DATA.tests
    with pytest.raises(ValueError, match="its clients_per_task is 2, now 1"):
        _run("fedlora", tmp_path / "split", rounds=2, resume=True)
    with pytest.raises(ValueError, match="clients_per_task must be >= 1"):
        SimConfig(clients_per_task=0)


def test_a_fine_tunes_loss_is_a_finalize_row_written_once_even_when_the_run_is_extended(tmp_path: Path) -> None:
    _run("fedlora", tmp_path / "ft", rounds=1, embed=False)
    run = _run("fedlora", tmp_path / "ft", rounds=2, resume=True, embed=False)  # extended: finalized again
    finals = [x for x in _rows(run) if x.get("stage") == "finalize"]
    assert sorted(x["client"] for x in finals) == sorted(DATA.client_ids)  # the first end's rows were dropped
    for row in finals:
        assert row["round"] == 2 and row["status"] == "ok" and row["finetune_steps"] >= 1
        assert np.isfinite(row["finetune_loss"]) and row["finetune_loss"] > 0
    fedit = _run("fedit", tmp_path / "fedit", rounds=1, embed=False)
    assert not any(x.get("stage") == "finalize" for x in _rows(fedit))  # nothing personalised, nothing to report


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--clients-per-task", "0", "--clients-per-task must be >= 1"),  # was a ZeroDivisionError
    ("--timeout", "-1", "client_timeout_s must be >= 0"),  # was a run whose every fit failed
    ("--max-grad-norm", "-1", "--max-grad-norm must be >= 0"),  # was clipping silently off
    ("--sample-rate", "-1", "sample_rate must be in (0, 1]"),  # was a traceback from inside round 0
    ("--rounds", "0", "rounds must be >= 1"),
    ("--max-steps", "-1", "max_steps must be >= 1 or None"),
])
def test_the_train_command_refuses_a_bad_setting_in_one_line_before_training(
        tmp_path: Path, flag: str, value: str, named: str) -> None:
    from fedmosaic.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--method", "fedit", "--data", "generated", "--n-train", "5", "--n-test", "1", "--families",
              ",".join(FAMILIES), "--rounds", "1", "--model", "tiny", "--preset", "tiny", "--out", str(out),
              flag, value])
    assert str(exc.value).startswith("fedmosaic train: ") and named in str(exc.value)
    assert not out.exists()  # refused before anything was written
