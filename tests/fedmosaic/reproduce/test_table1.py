"""``fedmosaic reproduce``: cells (method x seed x weighting rule) trained, evaluated, resumed and tabulated.

End to end on the tiny model (1 round, a few examples): FedIT and FedDPA-T over two seeds, FedDPA-T
scored with the paper's rule and the calibrated one from the same training run. The table's means and
sample standard deviations are recomputed here from the cell files and from each run's own evaluation;
a second invocation finds every cell finished and neither trains nor evaluates.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmosaic.reproduce import cli, runs, table1, tables
from fedmosaic.reproduce.options import Table1Options, default_preset
from training.local.regime import BUDGETS

ARGS = ["--methods", "fedit,feddpa-t", "--data", "generated", "--data-option", "n_train=4",
        "--data-option", "n_test=2", "--data-option", "families=sorting,capitals", "--model", "tiny",
        "--preset", "tiny", "--rounds", "1", "--seeds", "0", "1", "--limit", "2", "--max-new-tokens", "2",
        "--dtype", "float32"]


def _options(argv: list[str]) -> Table1Options:
    """``fedmosaic reproduce ARGV``'s options, parsed by the subcommand's own parser."""
    sub = argparse.ArgumentParser().add_subparsers()
    return cli.options(cli.add_reproduce_arguments(sub).parse_args(argv))


def _main(argv: list[str]) -> dict[str, Any]:
    """``fedmosaic reproduce ARGV``: its report."""
    return table1.reproduce(_options(argv))


def test_aggregate_is_mean_and_sample_std_over_seeds() -> None:
    cells = [{"method": "fedit", "label": "FedIT", "rule": "native", "seed": s, "train_seconds": t, "eval_seconds": 2.0,
              "personalization": {"values": {"a": a, "b": b}, "avg": (a + b) / 2},
              "ttp": {"values": {"a": 1.0, "b": 2.0}, "avg": 1.5}}
             for s, (a, b, t) in enumerate([(10.0, 20.0, 5.0), (14.0, 22.0, 7.0), (12.0, 27.0, 6.0)])]
    (row,) = tables.aggregate(cells)
    assert row["personalization"]["values"]["a"]["mean"] == pytest.approx(12.0)
    assert row["personalization"]["values"]["a"]["std"] == pytest.approx(statistics.stdev([10, 14, 12]))
    assert row["personalization"]["avg"]["std"] == pytest.approx(statistics.stdev([15.0, 18.0, 19.5]))
    assert row["ttp"]["values"]["b"] == {"mean": 2.0, "std": 0.0, "n": 3} and row["seeds"] == [0, 1, 2]
    assert row["train_seconds"]["mean"] == pytest.approx(6.0)
    assert tables.aggregate(cells[:1])[0]["personalization"]["avg"]["std"] == 0.0
    md = tables.markdown([row], cells, {"data": "d", "preset": "p", "metric": "rouge1", "evaluation": "all"})
    assert "| FedIT | 0,1,2 | 17.50 ± 2.29 | 1.50 ± 0.00 | 6 | 2 |" in md
    assert "| FedIT | 12.00 ± 2.00 | 23.00 ± 3.61 | 17.50 ± 2.29 |" in md
    one = tables.markdown(tables.aggregate(cells[:1]), cells[:1], {"data": "d", "preset": "p", "metric": "rouge1",
                                                                 "evaluation": "all"})
    assert "| FedIT | 0 | 15.00 | 1.50 | 5 | 2 |" in one and "±" not in one.split("\n", 1)[1].split("Per cell")[0]


def test_unknown_preset_and_method_fail_in_one_line() -> None:
    with pytest.raises(SystemExit, match="unknown preset 'nope'"):
        _main(["--methods", "fedit", "--preset", "nope"])
    with pytest.raises(SystemExit, match="unknown methods"):
        _main(["--methods", "fedxyz"])
    preset, note = default_preset()
    assert preset == "repro" if "repro" in BUDGETS else (preset == "small" and "repro" in note)


def test_cells_end_to_end_with_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "t1"
    import fedmosaic.evaluation.evaluate as evaluate

    generated: list[tuple[str, int]] = []
    real_generate = evaluate._generate_into

    def recording(cache, backend, items, desc):  # noqa: ANN001, ANN202
        generated.extend((it.key, it.i) for it in items)
        return real_generate(cache, backend, items, desc)

    monkeypatch.setattr(evaluate, "_generate_into", recording)
    report = _main([*ARGS, "--out", str(out)])
    monkeypatch.undo()
    assert report["failed"] == [] and report["skipped"] == []
    # the bare base model answers once for the whole table (4 prompts), not once per run (4 runs)
    assert sum(1 for key, _ in generated if key == "base") == 4
    assert sum(1 for key, _ in generated if key == "global") == 2 * 4  # FedDPA-T's own; FedIT's is its clients'
    assert all(c["base"] == report["cells"][0]["base"] for c in report["cells"])
    # each cell carries its run's training losses, as the run's metrics.jsonl has them
    rows_t = [json.loads(x) for x in (out / "feddpa-t" / "seed1" / "metrics.jsonl").read_text().splitlines()]
    mine = [r for r in rows_t if "client" in r and r.get("status") == "ok"]
    cells_by_key = {(c["method"], c["seed"], c["rule"]): c for c in report["cells"]}
    curves = cells_by_key[("feddpa-t", 1, "paper")]["loss_curves"]
    assert curves["rounds"]["loss"] == [round(statistics.fmean(r["loss"] for r in mine), 4)]
    assert curves["rounds"]["local_loss"] == [round(statistics.fmean(r["local_loss"] for r in mine), 4)]
    assert curves["finalize"] == {} and "| FedDPA-T | 1 |" in report["markdown"]
    routed = json.loads((out / "feddpa-t" / "seed1" / "eval" / "results.json").read_text())["feddpa_weights"]
    assert cells_by_key[("feddpa-t", 1, "calibrated")]["local_weight"] == {  # evaluated last: results.json is its
        "own_task": routed["own_client"]["mean"], "other_tasks": routed["other_clients"]["mean"]}
    assert 0 <= cells_by_key[("feddpa-t", 1, "paper")]["local_weight"]["own_task"] <= 1
    assert "local_weight" not in cells_by_key[("fedit", 1, "native")]
    # each cell says how many answers its evaluation generated (what its eval_seconds paid for)
    assert sum(c["answers"]["generated"] for c in report["cells"]) == len(generated)
    assert "The base model without adapters" in report["markdown"]
    names = sorted(p.name for p in (out / "cells").iterdir())
    assert names == sorted(f"{m}__seed{s}__{r}__rouge1-2-b1-t2.json" for m, rules in (("fedit", ["native"]),
                                                                       ("feddpa-t", ["paper", "calibrated"]))
                           for s in (0, 1) for r in rules)
    cells = {(c["method"], c["seed"], c["rule"]): c for c in report["cells"]}
    # a cell holds its run's own evaluation: the first (personalised) row of each block
    run = json.loads((out / "fedit" / "seed1" / "eval" / "results.json").read_text())
    assert cells[("fedit", 1, "native")]["ttp"]["avg"] == pytest.approx(run["tables"]["ttp"][0]["avg"])
    assert cells[("fedit", 1, "native")]["n_per_task"] == {"sorting": 2, "capitals": 2}
    # the two FedDPA-T rules come from one training run, evaluated with each rule
    paper, calibrated = cells[("feddpa-t", 0, "paper")], cells[("feddpa-t", 0, "calibrated")]
    assert paper["train_seconds"] == calibrated["train_seconds"] and paper["losses"] == calibrated["losses"]
    rows = {(r["method"], r["rule"]): r for r in report["rows"]}
    assert set(rows) == {("fedit", "native"), ("feddpa-t", "paper"), ("feddpa-t", "calibrated")}
    for (method, rule), row in rows.items():
        for block in ("personalization", "ttp"):
            per_seed = [cells[(method, s, rule)][block]["avg"] for s in (0, 1)]
            assert row[block]["avg"]["mean"] == pytest.approx(statistics.fmean(per_seed))
            assert row[block]["avg"]["std"] == pytest.approx(statistics.stdev(per_seed))
    md = (out / "table1.md").read_text()
    assert md == report["markdown"] and "| FedDPA-T (paper rule) | 0,1 |" in md
    assert "| FedDPA-T (calibrated, ours) | 0,1 |" in md and "the first 2 test examples per task" in md

    # resume: a finished cell is neither trained nor evaluated again; a removed one is redone alone
    (out / "cells" / "feddpa-t__seed1__calibrated__rouge1-2-b1-t2.json").unlink()
    evaluated: list[str] = []
    real_eval = table1.evaluate_run

    def no_training(*_a, **_k):  # noqa: ANN202
        raise AssertionError("a finished run was trained again")

    def counting_eval(run_dir, opts):  # noqa: ANN001, ANN202
        evaluated.append(f"{Path(run_dir).parent.name}/{opts.feddpa_weighting}")
        return real_eval(run_dir, opts)

    monkeypatch.setattr(runs, "run_federated", no_training)
    monkeypatch.setattr(table1, "evaluate_run", counting_eval)
    again = _main([*ARGS, "--out", str(out)])
    assert evaluated == ["feddpa-t/calibrated"] and again["failed"] == [] and len(again["skipped"]) == 5
    redone = next(c for c in again["cells"] if (c["method"], c["seed"], c["rule"]) == ("feddpa-t", 1, "calibrated"))
    assert redone["answers"] == {"generated": 0, "cached": cells[("feddpa-t", 1, "calibrated")]["answers"]["generated"]
                                 + cells[("feddpa-t", 1, "calibrated")]["answers"]["cached"]}
    assert "| Answers made |" in again["markdown"] and "| 0 |" in again["markdown"]
    again_rows = {(r["method"], r["rule"]): r for r in again["rows"]}
    assert again_rows[("fedit", "native")] == rows[("fedit", "native")]
    assert again_rows[("feddpa-t", "calibrated")]["ttp"]["avg"]["mean"] == pytest.approx(
        rows[("feddpa-t", "calibrated")]["ttp"]["avg"]["mean"])  # the cached predictions give the same scores
    evaluated.clear()
    _main([*ARGS, "--out", str(out)])
    assert evaluated == []
    # an invocation for some methods still tabulates every finished cell of the same settings
    alone = _main([*ARGS[:1], "fedit", *ARGS[2:], "--out", str(out)])
    assert {(r["method"], r["rule"]) for r in alone["rows"]} == set(rows) and evaluated == []
    # another evaluation setting is a new cell of the same trained run; another training setting is refused
    other = _main([*ARGS[:1], "fedit", *ARGS[2:], "--max-new-tokens", "3", "--out", str(out)])
    assert other["failed"] == [] and {r["method"] for r in other["rows"]} == {"fedit"}
    assert evaluated == ["fedit/None", "fedit/None"]  # seeds 0 and 1, from the runs already trained
    cut = _main([*ARGS[:1], "fedit", *ARGS[2:], "--ttp-limit", "1", "--out", str(out)])
    assert sorted(p.name for p in (out / "cells").glob("fedit__*-ttp1.json")) == [
        "fedit__seed0__native__rouge1-2-b1-t2-ttp1.json", "fedit__seed1__native__rouge1-2-b1-t2-ttp1.json"]
    assert [c["eval"]["ttp_limit"] for c in cut["cells"]] == [1, 1]
    assert "TTP: every model on the first 1 examples of each task" in cut["markdown"]
    with pytest.raises(SystemExit, match="another --out"):
        _main([*ARGS, "--rounds", "2", "--out", str(out)])


def test_fedlora_and_feddpa_f_start_from_fedits_rounds_bit_for_bit(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from training.algorithms.fedit import FedAvgClient

    common = [*ARGS[2:ARGS.index("--rounds")], "--rounds", "2", "--seeds", "0", "--limit", "2",
              "--max-new-tokens", "2", "--dtype", "float32"]
    derived, scratch = tmp_path / "derived", tmp_path / "scratch"
    assert _main(["--methods", "fedit", *common, "--out", str(derived)])["failed"] == []

    def no_rounds(*_a, **_k):  # noqa: ANN202
        raise AssertionError("FedIT's rounds were trained again")

    monkeypatch.setattr(FedAvgClient, "fit", no_rounds)  # FineTuneClient's rounds are FedAvgClient.fit
    report = _main(["--methods", "fedlora,feddpa-f", *common, "--out", str(derived)])
    monkeypatch.undo()
    assert report["failed"] == []
    fedit_train = json.loads((derived / "fedit" / "seed0" / "table1_train.json").read_text())
    cells = [c for c in report["cells"] if c["method"] != "fedit"]  # the report tabulates FedIT's cell too
    assert {c["method"] for c in cells} == {"fedlora", "feddpa-f"}
    for cell in cells:
        record = json.loads((derived / cell["method"] / "seed0" / "table1_train.json").read_text())
        assert record["rounds_from"] == cell["rounds_from"] == "fedit/seed0"
        assert record["losses"] == fedit_train["losses"] == cell["losses"]
        assert record["train_seconds"] == pytest.approx(fedit_train["train_seconds"] + record["own_seconds"], abs=0.11)
    # paper 000's orderings read pair by pair: each difference is the two cells' own, from their examples
    every = {(c["method"], c["rule"]): c for c in report["cells"]}
    got = {(r["a"], r["b"], r["block"]): r for r in report["orderings"]}
    assert set(got) == {(("fedit", "native"), ("fedlora", "native"), "personalization"),
                        *((("fedlora", "native"), ("feddpa-f", rule), block) for rule in ("paper", "calibrated")
                          for block in ("personalization", "ttp"))}
    for (a, b, block), row in got.items():
        assert row["delta"] == pytest.approx(every[b][block]["avg"] - every[a][block]["avg"], abs=1e-3)
        assert row["low"] <= row["delta"] <= row["high"] and row["seed"] == 0
    assert "| FedIT < FedLoRA | Pers. | 0 |" in report["markdown"]
    for cell_file in (derived / "cells").glob("*.json"):
        kept = json.loads((derived / "examples" / cell_file.name).read_text())
        assert "examples" not in json.loads(cell_file.read_text()) and set(kept["personalization"]) == {
            "sorting", "capitals"}

    # interrupted after its run began (run.json written, no summary): resumed, it still says whose rounds
    run_dir = derived / "fedlora" / "seed0"
    for name in ("table1_train.json", "summary.json"):
        (run_dir / name).unlink()
    for cell_file in (derived / "cells").glob("fedlora__*"):
        cell_file.unlink()
    again = _main(["--methods", "fedlora", *common, "--out", str(derived)])
    record = json.loads((run_dir / "table1_train.json").read_text())
    assert again["failed"] == [] and record["rounds_from"] == "fedit/seed0"
    assert record["losses"] == fedit_train["losses"] and record["train_seconds"] > fedit_train["train_seconds"]

    alone = _main(["--methods", "fedlora,feddpa-f", *common, "--out", str(scratch)])
    assert alone["failed"] == []
    for method in ("fedlora", "feddpa-f"):
        assert "rounds_from" not in json.loads((scratch / method / "seed0" / "table1_train.json").read_text())
        files = sorted(p.relative_to(scratch) for p in (scratch / method / "seed0" / "adapters").rglob("*.safetensors"))
        assert len(files) >= 3  # the global and each client's local adapter
        for rel in files:
            a, b = load_file(str(scratch / rel)), load_file(str(derived / rel))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
    theirs = {(c["method"], c["rule"]): c for c in alone["cells"]}
    for cell in cells:  # the same adapters answer the same: every score equal
        other = theirs[(cell["method"], cell["rule"])]
        assert (cell["personalization"], cell["ttp"]) == (other["personalization"], other["ttp"])
    # with method options the rounds are trained (they may differ from FedIT's); a run of its own resumes
    third = tmp_path / "third"
    shutil.copytree(derived / "fedit", third / "fedit")
    opts = _options(["--methods", "fedlora", *common, "--out", str(third)])
    assert runs.rounds_source("fedlora", 0, opts, {}, {}) == third / "fedit" / "seed0"
    assert runs.rounds_source("fedlora", 0, opts, {"weighting": "examples"}, {}) is None
    assert runs.rounds_source("fedlora", 0, opts, {}, {"mu": 0.1}) is None
    assert runs.rounds_source("feddpa-t", 0, opts, {}, {}) is None
    (third / "fedlora" / "seed0").mkdir(parents=True)
    (third / "fedlora" / "seed0" / "run.json").write_text("{}")
    assert runs.rounds_source("fedlora", 0, opts, {}, {}) is None


def test_fedoas_leave_out_run_shares_the_table_and_is_never_mixed_up(tmp_path: Path) -> None:
    out = tmp_path / "t1"
    common = [*ARGS[2:ARGS.index("--seeds")], "--seeds", "0", "--limit", "2", "--max-new-tokens", "2",
              "--dtype", "float32", "--out", str(out)]
    assert _main(["--methods", "fedit", *common])["failed"] == []
    # the main methods' out directory takes FedOA's leave-one-task-out run (paper 001's protocol)
    report = _main(["--methods", "fedoa", *common, "--leave-out", "capitals"])
    assert report["failed"] == []
    (cell,) = [c for c in report["cells"] if c["method"] == "fedoa"]
    assert (out / "cells" / "fedoa__seed0__native__rouge1-2-b1-t2-lo-capitals.json").is_file()
    assert "capitals" in json.dumps(cell["ood"]) and set(cell["personalization"]["values"]) == {"sorting"}
    table = (out / "table1.md").read_text()  # the held-out task's scores reach the table, with the global's
    assert "Out of distribution" in table and "| FedOA | 0 | capitals |" in table
    run = json.loads((out / "fedoa" / "seed0" / "run.json").read_text())
    assert run["data_options"]["leave_out"] == ["capitals"]
    # the same run is never reused or resumed for another held-out task, nor without one
    with pytest.raises(SystemExit, match="data options"):
        _main(["--methods", "fedoa", *common, "--leave-out", "sorting"])
    with pytest.raises(SystemExit, match="data options"):
        _main(["--methods", "fedoa", *common])
    with pytest.raises(SystemExit, match="needs task names"):
        _main(["--methods", "fedoa", *common, "--leave-out", ","])
    with pytest.raises(SystemExit, match="another --out"):  # shared settings are still checked
        _main(["--methods", "fedit", *common, "--rounds", "3"])


def test_loss_curves_average_the_clients_rows_by_round_and_keep_the_fine_tune_apart(tmp_path: Path) -> None:
    rows = [{"round": 0, "client": "a", "status": "ok", "loss": 1.0, "steps": 3.0},
            {"round": 0, "client": "b", "status": "ok", "loss": 2.0, "steps": 3.0},
            {"round": 0, "client": "c", "status": "failed", "error": "timeout"},
            {"round": 0, "aggregate": True, "loss": 1.5},
            {"round": 1, "client": "a", "status": "ok", "loss": 0.5, "local_loss": 3.0, "local_reg": 2.0},
            {"round": 1, "client": "b", "status": "ok", "loss": 0.25},
            {"round": 2, "stage": "finalize", "client": "a", "status": "ok", "finetune_loss": 0.2},
            {"round": 2, "stage": "finalize", "client": "b", "status": "ok", "finetune_loss": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    curves = runs.loss_curves(tmp_path)
    # a regulariser's value is kept beside the loss that includes it (FedOA's local_reg in local_loss)
    assert curves == {"rounds": {"loss": [1.5, 0.375], "local_loss": [3.0], "local_reg": [2.0]},
                      "finalize": {"finetune_loss": 0.3}}
    md = "\n".join(tables.loss_lines([{"label": "FedLoRA", "seed": 0, "loss_curves": curves}]))
    assert "| FedLoRA | 0 | 1.500 → 0.375 | 3.000 | 2.000 | 0.300 |" in md


def test_ood_lines_give_the_clients_own_models_and_the_global_on_the_held_out_tasks() -> None:
    cells = [{"label": "FedIT", "seed": 0},  # no held-out task: no row
             {"label": "FedOA", "seed": 0, "ood": {"held_out": ["snli"], "metric": "rouge1",
                                                   "mean": {"0": 20.0, "2": 30.0, "3": 40.0,
                                                            "global": 36.0, "base": 15.5}}}]
    md = "\n".join(tables.ood_lines(cells))
    assert "| FedOA | 0 | snli | 30.00 (20.00-40.00, 3 clients) | 36.00 | 15.50 |" in md
    assert "FedIT" not in md
    assert tables.ood_lines(cells[:1]) == []


def test_the_base_line_is_read_from_a_cell_trained_on_every_client() -> None:
    oa = {"label": "FedOA", "seed": 0, "base": {"personalization": 16.66, "ttp": 17.0},
          "ood": {"held_out": ["snli"], "mean": {"global": 1.0}}}
    fedit = {"label": "FedIT", "seed": 0, "base": {"personalization": 16.5, "ttp": 17.91}}
    assert "Personalization 16.50, TTP 17.91 (the same" in tables.base_lines([oa, fedit])[1]
    alone = tables.base_lines([oa])[1]
    assert "Personalization 16.66, TTP 17.00 (over the clients of FedOA's run without snli)" in alone
    assert tables.base_lines([{"label": "Local", "seed": 0}]) == []


def test_a_run_with_failed_client_fits_makes_no_cell_and_names_the_error(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The round loop leaves failed clients out and finishes the run; the table must not score what it left."""
    from training.algorithms import fedit

    def broken(self, ins, ctx):  # noqa: ANN001, ANN202 - the client's fit, as a dtype bug once broke FedAMoLE's
        raise RuntimeError("expected m1 and m2 to have the same dtype")

    monkeypatch.setattr(fedit.FedAvgClient, "fit", broken)
    out = tmp_path / "t1"
    common = [*ARGS[2:ARGS.index("--seeds")], "--seeds", "0", "--limit", "2", "--max-new-tokens", "2",
              "--dtype", "float32", "--out", str(out)]
    report = _main(["--methods", "fedit", *common])
    (failure,) = report["failed"]
    assert "client fits failed in training" in failure["error"] and "same dtype" in failure["error"]
    # grouped as the train command reports them: one line per cause, with its count, rounds and clients
    assert "(2 failed (round 0; capitals, sorting): RuntimeError: expected m1" in failure["error"]
    assert not list((out / "cells").glob("*.json")) and report["cells"] == []
    # asked again, the finished but failed run is still refused, not reused as a cell
    monkeypatch.undo()
    again = _main(["--methods", "fedit", *common])
    assert len(again["failed"]) == 1 and not list((out / "cells").glob("*.json"))
