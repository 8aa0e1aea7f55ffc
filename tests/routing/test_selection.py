"""The calibrated map's constants are chosen per client on a validation split of its own training prompts.

The selection must pick the grid point that a naive loop over whole calibrations picks (each grid point
calibrated from scratch with :func:`routing.calibration.calibrate` on a fold's fit part and scored with
:meth:`Calibration.weight`), record it in the calibration, and never read a test example.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from routing.calibration import Calibration, calibrate
from routing.selection import GUARD_GRID, OWN_GRID, background_halves, fold_count, instance_folds, select_constants

H = 24


def world(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's states (a task of its own, spread over a few directions) and a background on many topics,
    some close to the client's task (so guard and own quantile trade misses against leaks)."""
    rng = np.random.default_rng(seed)
    common = np.zeros(H)
    common[0] = 10.0
    own = common + rng.normal(size=(40, 4)) @ rng.normal(size=(4, H)) + 0.5 * rng.normal(size=(40, H))
    centres = rng.normal(scale=3.0, size=(60, H))
    centres[:6] = own.mean(axis=0) - common + rng.normal(scale=0.8, size=(6, H))  # near the client's task
    background = common + centres + 0.5 * rng.normal(size=(60, H))
    return own.astype(np.float32), background.astype(np.float32)


def naive_choice(own: np.ndarray, background: np.ndarray) -> tuple[float, float, list[float]]:
    """Every grid point calibrated from scratch per (fold, half), weights one prompt at a time."""
    folds = instance_folds(len(own), fold_count(len(own)))
    halves = background_halves(len(background))
    losses = []
    for guard in GUARD_GRID:
        for q in OWN_GRID:
            parts = []
            for fold in folds:
                fit = own[[i for i in range(len(own)) if i not in set(fold.tolist())]]
                for ref, neg in ((halves[0], halves[1]), (halves[1], halves[0])):
                    cal = calibrate(fit, background[ref], background_quantile=guard, own_quantile=q)
                    score = cal.scorer(fit)
                    hit = [cal.weight(float(s), 1.0) for s in score(own[fold])]
                    leak = [cal.weight(float(s), 1.0) for s in score(background[neg])]
                    parts.append(0.5 * (statistics.fmean(1.0 - h for h in hit) + statistics.fmean(leak)))
            losses.append(statistics.fmean(parts))
    best = min(range(len(losses)), key=lambda j: (losses[j] > min(losses) + 1e-9, j))
    return GUARD_GRID[best // len(OWN_GRID)], OWN_GRID[best % len(OWN_GRID)], losses


@pytest.mark.parametrize("seed", [0, 1])
def test_selection_picks_the_grid_point_a_naive_loop_picks(seed: int) -> None:
    own, background = world(seed)
    guard, q, losses = naive_choice(own, background)
    chosen = select_constants(own, background)
    assert (chosen.guard_quantile, chosen.own_quantile) == (guard, q)
    assert [loss for _, _, loss in chosen.losses] == pytest.approx(losses, abs=1e-9)
    assert max(losses) - min(losses) > 0.01  # the grid matters on this client: not a tie at the first point


def test_calibration_records_the_chosen_constants_and_explicit_ones_skip_the_choice() -> None:
    own, background = world(0)
    chosen = select_constants(own, background)
    cal = calibrate(own, background)
    assert cal.own_quantile == chosen.own_quantile
    assert cal.summary["background_quantile"] == chosen.guard_quantile
    assert cal.background == pytest.approx(float(np.quantile(cal.scorer(own)(background), chosen.guard_quantile)))
    selection = Calibration.from_json(json.loads(json.dumps(cal.to_json()))).summary["selection"]
    assert selection["selected"] and selection["folds"] == 5
    assert len(selection["grid"]) == len(GUARD_GRID) * len(OWN_GRID)
    fixed = calibrate(own, background, background_quantile=0.9)
    assert "selection" not in fixed.summary and fixed.own_quantile == 0.25
    small = calibrate(own[:5], background)  # too few instances to split into folds: the first constants, said so
    assert small.own_quantile == 0.25 and small.summary["background_quantile"] == 0.98
    assert small.summary["selection"]["selected"] is False


def test_calibrate_run_chooses_from_training_prompts_and_never_reads_a_test_example(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fedmosaic.calibrate_cli as cli
    import routing.calibration as calibration
    from fedmosaic.cli import main
    from training.data import load_run_dataset

    out = tmp_path / "run"
    assert main(["train", "--method", "feddpa-t", "--data", "generated", "--n-train", "12", "--n-test", "2",
                 "--families", "sorting,capitals", "--rounds", "1", "--model", "tiny", "--preset", "tiny",
                 "--out", str(out)]) == 0

    class Untouchable(dict):
        def __getattribute__(self, name: str):  # noqa: ANN204 - any use of the test sets fails the test
            raise AssertionError(f"the calibration read the test sets ({name})")

    def no_tests(cfg: dict, **kwargs: object):  # noqa: ANN202
        return dataclasses.replace(load_run_dataset(cfg, **kwargs), tests=Untouchable())

    seen: list[np.ndarray] = []
    real = calibration.select_constants

    def spy(instances: np.ndarray, background: np.ndarray):  # noqa: ANN202
        seen.append(np.asarray(instances))
        return real(instances, background)

    monkeypatch.setattr(cli, "load_run_dataset", no_tests)
    monkeypatch.setattr(calibration, "select_constants", spy)
    result = cli.calibrate_run(out, rebuild=True, dtype="float32")
    assert len(seen) == len(result) == 2
    for client, instances in zip(result, seen, strict=True):
        index = np.load(out / "adapters" / "clients" / client / "embeddings.npy")
        assert np.array_equal(instances, index) and len(index) == 12  # the client's training prompts only
        cal = Calibration.load(out / "adapters" / "clients" / client)
        assert cal is not None and cal.summary["selection"]["selected"]
        assert cal.own_quantile == cal.summary["selection"]["own_quantile"]
