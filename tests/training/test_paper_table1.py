"""bench/paper_table1.py --seeds: every cell's mean and standard deviation over the seeds' runs."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():  # noqa: ANN202 - the script is not a package module
    spec = importlib.util.spec_from_file_location("paper_table1", ROOT / "bench" / "paper_table1.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _results(values: list[float], avg: float) -> dict:
    return {"tables": {"personalization": [{"label": "m", "values": {"a": values[0], "b": values[1]}, "avg": avg}],
                       "ttp": [{"label": "m", "values": {"a": 1.0, "b": 2.0}, "avg": 1.5}]}}


def test_cell_stats_are_mean_and_sample_std_over_seeds() -> None:
    bench = _bench()
    runs = [_results([10.0, 20.0], 15.0), _results([14.0, 22.0], 18.0), _results([12.0, 27.0], 19.5)]
    stats = bench.cell_stats(runs)
    cell = stats["personalization"]["m"]["a"]
    assert cell["mean"] == pytest.approx(12.0) and cell["std"] == pytest.approx(statistics.stdev([10, 14, 12]))
    assert stats["personalization"]["m"]["avg"]["std"] == pytest.approx(statistics.stdev([15.0, 18.0, 19.5]),
                                                                          abs=1e-4)
    assert stats["ttp"]["m"]["b"] == {"mean": 2.0, "std": 0.0}
    assert bench.cell_stats(runs[:1])["personalization"]["m"]["a"]["std"] == 0.0
    md = bench.stats_markdown({"fedit": stats}, "rouge1")
    assert "| Personalization | m | 12.00 ± 2.00 |" in md


def test_two_seeds_end_to_end_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "t1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "paper_table1.py"), "--methods", "fedit", "--data", "generated",
         "--model", "tiny", "--preset", "tiny", "--rounds", "1", "--seeds", "2", "--limit", "1",
         "--max-new-tokens", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert (out / "fedit" / "seed0" / "summary.json").is_file() and (out / "fedit" / "seed1" / "summary.json").is_file()
    assert len(report["methods"]["fedit"]["train"]) == 2
    assert (out / "table1_mean_std.md").read_text() == report["table_mean_std"]
    cells = report["cells"]["fedit"]["personalization"]
    assert all("mean" in v and "std" in v for row in cells.values() for v in row.values())
