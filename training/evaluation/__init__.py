"""Evaluation maths: scores, Table-1 blocks, plots, the resumable prediction cache (paper 000 s5.1)."""

from training.evaluation.metrics import METRICS, Scores, example_scores, score
from training.evaluation.predictions import Prediction, PredictionCache

__all__ = ["METRICS", "Prediction", "PredictionCache", "Scores", "example_scores", "score"]
