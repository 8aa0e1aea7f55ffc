"""Scores of generated answers: ROUGE-1 and ROUGE-L F x 100 (``rouge-score``, no stemming), exact match.

Paper 000 reports ROUGE-1 (section 5.1); its reference computes it with ``rouge_score``'s default
tokenizer (lower-case, non-alphanumerics to spaces) without stemming (docs/methods.md 2.6). We average the
per-example F-measure (the paper's bootstrap "mid" is that mean up to resampling noise). Empty
predictions score 0. Trailing ``</s>`` / end-of-turn markers are stripped first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

METRICS = ("rouge1", "rougeL", "exact")
_TRAILING = re.compile(r"(\s*(</s>|<\|im_end\|>|<\|endoftext\|>))+\s*$")


def clean(text: str) -> str:
    """Strip whitespace and trailing end-of-sequence markers."""
    return _TRAILING.sub("", text).strip()


@lru_cache(maxsize=1)
def _scorer() -> Any:
    """The ROUGE-1/ROUGE-L scorer, built once (``rouge_score.rouge_scorer.RougeScorer``)."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=False)


@dataclass(frozen=True)
class Scores:
    """Mean scores over a set of examples, each x 100."""

    rouge1: float
    rougeL: float
    exact: float
    n: int

    def get(self, metric: str) -> float:
        """Return one metric by name (``rouge1``, ``rougeL`` or ``exact``)."""
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; choose from {METRICS}")
        return float(getattr(self, metric))

    def asdict(self) -> dict[str, float]:
        """Plain dict for JSON."""
        return {"rouge1": self.rouge1, "rougeL": self.rougeL, "exact": self.exact, "n": self.n}


def example_scores(prediction: str, reference: str, normalize: bool = False) -> dict[str, float]:
    """ROUGE-1 F, ROUGE-L F and exact match (each x 100) for one pair."""
    pred, ref = clean(prediction), clean(reference)
    exact = pred.lower() == ref.lower() if normalize else pred == ref
    if not pred:
        return {"rouge1": 0.0, "rougeL": 0.0, "exact": 100.0 * exact}
    s = _scorer().score(ref, pred)
    return {"rouge1": 100.0 * s["rouge1"].fmeasure, "rougeL": 100.0 * s["rougeL"].fmeasure, "exact": 100.0 * exact}


def mean_scores(rows: Sequence[dict[str, float]]) -> Scores:
    """The mean of per-example scores (:func:`example_scores` rows); zeros for no rows."""
    n = len(rows)
    if not n:
        return Scores(0.0, 0.0, 0.0, 0)
    return Scores(rouge1=sum(r["rouge1"] for r in rows) / n, rougeL=sum(r["rougeL"] for r in rows) / n,
                  exact=sum(r["exact"] for r in rows) / n, n=n)


def score(predictions: Sequence[str], references: Sequence[str], normalize: bool = False) -> Scores:
    """Mean scores of aligned predictions and references.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    return mean_scores([example_scores(p, r, normalize) for p, r in zip(predictions, references, strict=True)])
