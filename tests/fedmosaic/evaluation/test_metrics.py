"""Scores on hand-checked pairs, Table-1 blocks on synthetic scores, plots, the prediction cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmosaic.evaluation import plots, tables
from fedmosaic.evaluation.predictions import Prediction, PredictionCache
from training.scoring import Scores, example_scores, score


def test_rouge_and_exact_on_hand_checked_pairs() -> None:
    # pred 3 unigrams all in ref; ref has 6: P = 1, R = 1/2, F = 2/3. LCS = 3, same F.
    s = example_scores("the cat sat", "the cat sat on the mat")
    assert s["rouge1"] == pytest.approx(200 / 3) and s["rougeL"] == pytest.approx(200 / 3) and s["exact"] == 0
    # same bag of words in another order: ROUGE-1 = 100, LCS = 1 of 2: ROUGE-L = 50 (lower-cased, no stemming).
    s = example_scores("Mat the", "the mat")
    assert s["rouge1"] == pytest.approx(100) and s["rougeL"] == pytest.approx(50)
    assert example_scores("cats", "cat")["rouge1"] == 0  # no stemming, as the paper
    assert example_scores("yes</s>", "yes")["exact"] == 100
    assert example_scores("", "yes") == {"rouge1": 0.0, "rougeL": 0.0, "exact": 0.0}
    assert example_scores("Yes", "yes", normalize=True)["exact"] == 100
    mean = score(["the cat sat", "Mat the"], ["the cat sat on the mat", "the mat"])
    assert mean.rouge1 == pytest.approx((200 / 3 + 100) / 2) and mean.n == 2
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        score(["a", "b"], ["a"])


def synthetic_grid() -> dict[str, dict[str, Scores]]:
    def s(v: float) -> Scores:
        return Scores(v, v / 2, 0.0, 10)

    return {
        "0": {"a": s(80), "b": s(20)},
        "1": {"a": s(30), "b": s(90)},
        "global": {"a": s(50), "b": s(40)},
        "base": {"a": s(10), "b": s(10)},
    }


def test_blocks_take_the_diagonal_and_the_row_mean() -> None:
    blocks = tables.block_rows("FedX", synthetic_grid(), ["0", "1"], {"0": "a", "1": "b"}, "rouge1")
    pers, ttp = blocks["personalization"], blocks["ttp"]
    assert pers[0].values == (80, 90) and pers[0].avg == 85
    assert ttp[0].values == (50, 60) and ttp[0].avg == 55
    assert pers[1].label == "FedX [global]" and pers[1].values == (50, 40) and ttp[1].values == (45, 45)
    md = tables.markdown(blocks, ["a", "b"], "rouge1")
    assert "| **Personalization** |" in md and "| FedX | 80.00 | 90.00 | 85.00 |" in md
    assert "| **Test-Time Personalization** |" in md
    assert tables.blocks_json(blocks, ["a", "b"])["ttp"][0]["values"] == {"a": 50, "b": 60}
    rl = tables.block_rows("FedX", synthetic_grid(), ["0", "1"], {"0": "a", "1": "b"}, "rougeL")
    assert rl["personalization"][0].values == (40, 45)
    merged = tables.merge_blocks([blocks, tables.block_rows("FedY", synthetic_grid(), ["0", "1"],
                                                           {"0": "a", "1": "b"}, "rouge1", extra=())])
    assert [r.label for r in merged["personalization"]] == ["FedX", "FedX [global]", "FedX [base]", "FedY"]


def test_plots_write_png(tmp_path: Path) -> None:
    for path in (
        plots.plot_rounds({"global": {1: 10.0, 2: 20.0}}, "rouge1", tmp_path / "r.png"),
        plots.plot_weights({"a": [0.1, 0.4], "b": [0.9]}, tmp_path / "w.png"),
        plots.plot_scores({"0": {"a": 1.0, "b": 2.0}}, tmp_path / "s.png", "rouge1"),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prediction_cache_resumes_after_interruption(tmp_path: Path) -> None:
    cache = PredictionCache(tmp_path)
    prompts = [f"p{i}" for i in range(5)]
    calls: list[list[str]] = []

    def flaky(ps):
        calls.append(list(ps))
        if len(calls) == 2:
            raise KeyboardInterrupt  # interrupted during the second batch
        return [p.upper() for p in ps]

    with pytest.raises(KeyboardInterrupt):
        cache.fill("final", "0", "t", prompts, prompts, flaky, batch_size=2)
    path = cache.path("final", "0", "t")
    with path.open("a") as fh:
        fh.write('{"i": 4, "predic')  # a torn write at the end
    calls.clear()
    out = cache.fill("final", "0", "t", prompts, prompts, lambda ps: calls.append(list(ps)) or [p.upper() for p in ps],
                     batch_size=2)
    assert out == ["P0", "P1", "P2", "P3", "P4"]
    assert calls == [["p2", "p3"], ["p4"]]  # only the missing rows were generated
    calls.clear()
    changed = ["p0", "p1", "p2", "p3", "q4"]  # a changed prompt is recomputed, never reused
    out = cache.fill("final", "0", "t", changed, changed, lambda ps: calls.append(list(ps)) or ["x"] * len(ps))
    assert out[-1] == "x"
    assert calls == [["q4"]]


def test_prediction_cache_tags_and_extras(tmp_path: Path) -> None:
    cache = PredictionCache(tmp_path)
    prompts = ["p0", "p1"]
    out = cache.fill("final", "0", "t", prompts, ["r0", "r1"],
                     lambda ps: [Prediction(p.upper(), {"weights": {"global": 0.25}}) for p in ps], tag="greedy")
    assert out == ["P0", "P1"]
    rows = cache.rows("final", "0", "t", prompts, tag="greedy")
    assert rows[0] == {"i": 0, "prompt": "p0", "prediction": "P0", "reference": "r0", "tag": "greedy",
                       "weights": {"global": 0.25}}
    assert cache.missing("final", "0", "t", prompts, tag="greedy") == []
    assert cache.missing("final", "0", "t", prompts, tag="beams=4") == [0, 1]  # another setting: recomputed
    with pytest.raises(KeyError, match="lacks valid rows"):
        cache.rows("final", "0", "t", prompts, tag="beams=4")
    cache.append("final", "0", "t", [{"i": 1, "prompt": "p1", "prediction": "new", "tag": "beams=4"}])
    assert cache.missing("final", "0", "t", prompts, tag="beams=4") == [0]  # the last row of an index wins
    assert plots.plot_weights({"a": [0.7, 0.9]}, tmp_path / "w.png", others={"a": [0.1], "b": [0.2]}).is_file()
