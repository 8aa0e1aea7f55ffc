"""The end-of-training check of a FedDPA client's local adapter on its held-out examples (our addition).

FedDPA (paper 000, section 4.3) serves a client's own prompts with ``(1 - lambda, lambda)`` over its
global and local adapters, on the premise that the local adapter helps there. Under a small training
budget that premise can fail: on FedDPA dataset 1 at ``--preset small`` the local mix scored below the
global adapter alone on 6 of the 8 clients' own tasks (docs/feddpa-weighting.md). Nothing in
the weighting rule can see this; only the client's own answers can.

So a client that holds out part of its examples (``fedmosaic train --hold-out SHARE``, never trained
on) decodes them greedily twice at the end of training, with the global adapter alone and with the
mix at ``lambda``, and scores each answer with the evaluation's metric (ROUGE-1, ``training.scoring``).
The *gain* is 1 only when the mix is better with evidence: its mean score is higher *and* it answers
significantly more examples better than worse (a one-sided sign test over the examples whose two
scores differ, ``p <= alpha``, 0.05 by default). A mean alone was not enough: on FedDPA dataset 1, the
web_nlg client's mix scored 0.83 ROUGE-1 higher on its 30 held-out examples from 7 better and 6 worse
answers, and 2.2 lower (29.54 vs 31.74) on the task's 200 test examples. A local adapter has to earn
its weight, since a weight above 0 costs a second prefill of every prompt under the exact rule and
answers some other task's prompts with the local adapter (a tie is no evidence that it helps). The
calibration stores the verdict (``routing.calibration``), and the calibrated weighting scales
``lambda`` by it, so a client whose local adapter did not help is served the global adapter. Only the
client's own examples enter, on its own node; ``fedmosaic calibrate --gate`` checks a finished run's
clients again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy.stats import binomtest

from adapters import AdaptedModel
from adapters.generation import GenerationConfig, generate
from models import LoadedModel
from training.data import PromptConfig, Record, prompt_texts
from training.scoring import example_scores

METRIC = "rouge1"
ALPHA = 0.05  # the sign test's level


@dataclass(frozen=True)
class GateResult:
    """What a client's check measured.

    Attributes:
        gain: 1.0 to keep ``lambda`` (the mix is better: higher mean, ``p_value <= alpha``), 0.0 to serve the
            global alone.
        lambda_: the local weight checked.
        global_score: mean ROUGE-1 of the global adapter alone on the held-out examples (x 100).
        mixed_score: mean ROUGE-1 of ``(1 - lambda, lambda)`` over (global, local).
        n: held-out examples scored.
        wins: examples the mix answered better (higher ROUGE-1).
        losses: examples the global alone answered better.
        p_value: the one-sided sign test's p-value of ``wins`` among ``wins + losses`` (1 when both are 0).
        alpha: the test's level.
    """

    gain: float
    lambda_: float
    global_score: float
    mixed_score: float
    n: int
    wins: int = 0
    losses: int = 0
    p_value: float = 1.0
    alpha: float = ALPHA

    def asdict(self) -> dict[str, Any]:
        """The calibration's ``gate`` record."""
        return {"metric": METRIC, "lambda": self.lambda_, "global": self.global_score, "mixed": self.mixed_score,
                "n": self.n, "wins": self.wins, "losses": self.losses, "p_value": self.p_value,
                "alpha": self.alpha, "gain": self.gain}


def verdict(global_scores: Sequence[float], mixed_scores: Sequence[float], lambda_: float,
            alpha: float = ALPHA) -> GateResult:
    """The gate from per-example scores of the global adapter alone and of the mix (aligned lists).

    Raises:
        ValueError: the lists are empty or differ in length, or ``alpha`` is outside (0, 1).
    """
    if not global_scores or len(global_scores) != len(mixed_scores):
        raise ValueError(f"the gate needs aligned scores, got {len(global_scores)} and {len(mixed_scores)}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"the sign test's level must be in (0, 1), got {alpha}")
    n = len(global_scores)
    wins = sum(m > g for g, m in zip(global_scores, mixed_scores, strict=True))
    losses = sum(m < g for g, m in zip(global_scores, mixed_scores, strict=True))
    p = float(binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue) if wins + losses else 1.0
    base, mixed = sum(global_scores) / n, sum(mixed_scores) / n
    gain = 1.0 if mixed > base and p <= alpha else 0.0
    return GateResult(gain, float(lambda_), base, mixed, n, wins, losses, p, alpha)


def check_local(loaded: LoadedModel, adapted: AdaptedModel, style: str, examples: Sequence[Record],
                lambda_: float, alpha: float = ALPHA, max_new_tokens: int = GenerationConfig.max_new_tokens,
                batch_size: int = 8) -> GateResult:
    """Score ``examples`` with the global adapter alone and mixed with the local one at ``lambda_``.

    Args:
        loaded: the base model and its tokenizer.
        adapted: the model's adapters, the client's ``global`` and ``local`` loaded.
        style: the run's prompt template (``PromptConfig``).
        examples: the client's held-out examples.
        lambda_: the local adapter's weight in the mix (FedDPA's lambda), in (0, 1].
        alpha: the sign test's level (:func:`verdict`).
        max_new_tokens: greedy tokens per answer (default: ``fedmosaic eval``'s, the generation default).
        batch_size: prompts per ``generate`` batch.

    Raises:
        ValueError: no examples, or ``lambda_`` outside (0, 1], or ``alpha`` outside (0, 1).
    """
    if not examples:
        raise ValueError("the local adapter's check needs held-out examples")
    if not 0.0 < lambda_ <= 1.0:
        raise ValueError(f"the local weight to check must be in (0, 1], got {lambda_}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"the sign test's level must be in (0, 1), got {alpha}")
    prompts = prompt_texts(examples, loaded.tokenizer, PromptConfig.named(style))
    config = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch_size)
    scores = []
    for w in (0.0, float(lambda_)):
        answers = generate(adapted, loaded.model, loaded.tokenizer, prompts, ("global", "local"), [1.0 - w, w], config,
                           autocast=loaded.autocast)
        scores.append([example_scores(a, r.output)[METRIC] for a, r in zip(answers, examples, strict=True)])
    return verdict(scores[0], scores[1], lambda_, alpha)
