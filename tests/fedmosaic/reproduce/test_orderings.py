"""fedmosaic.reproduce.orderings: paper 000's orderings read as paired differences between two cells of a seed.

The point estimate must be the table's own difference (clients, or clients x tasks, weighing equally),
and the bootstrap interval must behave as resampling says: no width where every pair differs alike, the
exact binomial quantiles for a single outlier, and nothing computed for cells scored on other examples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedmosaic.reproduce import orderings


def _examples(own: dict[str, list[float]], ttp: dict[str, dict[str, list[float]]]) -> dict:
    return {"metric": "rouge1", "personalization": own, "ttp": ttp}


def test_the_difference_is_the_tables_and_a_constant_shift_has_no_width() -> None:
    a = {("c0",): [10.0, 20.0, 30.0], ("c1",): [0.0, 100.0]}  # unequal sizes: clients weigh equally
    b = {("c0",): [11.0, 21.0, 31.0], ("c1",): [3.0, 103.0]}
    diff = orderings.paired_difference(a, b)
    assert diff["delta"] == pytest.approx((1.0 + 3.0) / 2) and diff["n"] == 5
    assert diff["low"] == pytest.approx(2.0) and diff["high"] == pytest.approx(2.0)
    assert orderings.reading(diff) == "holds"
    same = orderings.paired_difference(a, a)
    assert (same["delta"], same["low"], same["high"]) == (0.0, 0.0, 0.0) and orderings.reading(same) == "tie"
    assert orderings.reading(orderings.paired_difference(b, a)) == "reversed"


def test_one_outlier_gives_the_binomial_quantiles() -> None:
    # ten pairs, one differing by 10: a resample's mean is 10 x Binomial(10, 0.1) / 10, whose 2.5 % and
    # 97.5 % quantiles are 0 and 3 (P(X <= 2) = 0.930, P(X <= 3) = 0.987)
    a = {("c",): [0.0] * 10}
    b = {("c",): [0.0] * 9 + [10.0]}
    diff = orderings.paired_difference(a, b, draws=4000)
    assert diff["delta"] == pytest.approx(1.0)
    assert diff["low"] == 0.0 and diff["high"] == 3.0 and orderings.reading(diff) == "tie"
    # the same by a plain loop over resamples, with its own generator: the same quantiles
    rng = np.random.default_rng(1)
    d = np.array(b[("c",)]) - np.array(a[("c",)])
    means = [d[rng.integers(0, 10, 10)].mean() for _ in range(4000)]
    assert list(np.percentile(means, [2.5, 97.5])) == [0.0, 3.0]


def test_cells_on_other_examples_are_not_compared() -> None:
    a = {("c0",): [1.0, 2.0]}
    assert orderings.paired_difference(a, {("c0",): [1.0]}) is None
    assert orderings.paired_difference(a, {("c1",): [1.0, 2.0]}) is None
    assert orderings.paired_difference({}, {}) is None


def test_ordering_rows_pair_cells_of_the_same_seed_and_the_markdown_reads_them() -> None:
    own_a = {"t0": [50.0] * 4, "t1": [40.0] * 4}
    own_b = {"t0": [60.0] * 4, "t1": [40.0, 40.0, 40.0, 44.0]}
    ttp = {"t0": {"t0": [1.0, 2.0], "t1": [3.0, 4.0]}, "t1": {"t0": [5.0, 6.0], "t1": [7.0, 8.0]}}
    cells = [{"method": m, "seed": s, "rule": "native"} for m in ("fedit", "fedlora") for s in (0, 1)]
    cells.append({"method": "feddpa-f", "seed": 0, "rule": "paper"})
    examples = {("fedit", 0, "native"): _examples(own_a, ttp), ("fedlora", 0, "native"): _examples(own_b, ttp),
                ("fedit", 1, "native"): _examples(own_a, ttp), ("fedlora", 1, "native"): _examples(own_a, ttp),
                ("feddpa-f", 0, "paper"): _examples(own_b, ttp)}
    rows = orderings.ordering_rows(cells, examples)
    by = {(r["a"], r["b"], r["block"], r["seed"]): r for r in rows}
    first = by[(("fedit", "native"), ("fedlora", "native"), "personalization", 0)]
    assert first["delta"] == pytest.approx((10.0 + 1.0) / 2) and first["n"] == 8
    assert by[(("fedit", "native"), ("fedlora", "native"), "personalization", 1)]["delta"] == 0.0
    ttp_row = by[(("fedlora", "native"), ("feddpa-f", "paper"), "ttp", 0)]
    assert ttp_row["delta"] == 0.0 and ttp_row["n"] == 8
    assert (("fedlora", "native"), ("feddpa-f", "paper"), "personalization", 1) not in by  # no seed-1 cell
    md = "\n".join(orderings.ordering_lines(rows, {"fedit": "FedIT", "fedlora": "FedLoRA", "feddpa-f": "FedDPA-F"}))
    assert "| FedIT < FedLoRA | Pers. | 0 | +5.50 |" in md
    assert "| FedIT < FedLoRA | Pers. | mean of 2 | +2.75 ± 3.89 | | 1 of 2 hold |" in md
    assert "| FedLoRA < FedDPA-F (paper) | TTP | 0 | +0.00 | [+0.00, +0.00] | tie |" in md
    assert orderings.ordering_lines([], {}) == []


def test_an_unreadable_examples_file_leaves_its_cell_out_with_a_message(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    torn, wrong, good = tmp_path / "torn.json", tmp_path / "wrong.json", tmp_path / "good.json"
    torn.write_text('{"personalization": {"c": [1.0')
    wrong.write_text("[1, 2]")
    good.write_text('{"metric": "rouge1", "personalization": {"c": [1.0]}, "ttp": {"c": {"t": [1.0]}}}')
    assert orderings.read_examples(torn) is None and orderings.read_examples(wrong) is None
    err = capsys.readouterr().err
    assert "torn.json unreadable" in err and "wrong.json holds no per-example scores" in err
    assert orderings.read_examples(good)["personalization"] == {"c": [1.0]}
