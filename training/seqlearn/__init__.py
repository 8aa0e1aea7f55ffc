"""pFedSeq's server-side sequential learners (paper 003): selective SSM, LSTM, MLP, and the update history."""

from training.seqlearn.history import Layout, UpdateHistory, calibrate, learner_step
from training.seqlearn.learners import KINDS, LSTMLearner, MLPLearner, SeqLearner, SSMLearner, make_learner
from training.seqlearn.ssm import MambaBlock, scan_backend, selective_scan

__all__ = [
    "KINDS", "LSTMLearner", "Layout", "MLPLearner", "MambaBlock", "SSMLearner", "SeqLearner", "UpdateHistory",
    "calibrate", "learner_step", "make_learner", "scan_backend", "selective_scan",
]
