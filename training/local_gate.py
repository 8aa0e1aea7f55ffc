"""The end-of-training check of a FedDPA client's local adapter on its held-out examples (our addition).

FedDPA (paper 000, section 4.3) serves a client's own prompts with ``(1 - lambda, lambda)`` over its
global and local adapters, on the premise that the local adapter helps there. Under a small training
budget that premise can fail: on FedDPA dataset 1 at ``--preset small`` the local mix scored below the
global adapter alone on 6 of the 8 clients' own tasks (README, "Instance-wise weighting"). Nothing in
the weighting rule can see this; only the client's own answers can.

So a client that holds out part of its examples (``fedmosaic train --hold-out SHARE``, never trained
on) decodes them greedily twice at the end of training, with the global adapter alone and with the
mix at ``lambda``, and scores both with the evaluation's metric (ROUGE-1, ``training.metrics``). The
*gain* is 1 when the mix scores higher and 0 otherwise: a local adapter has to earn its weight, since a
weight above 0 costs a second prefill of every prompt under the exact rule and answers some other
task's prompts with the local adapter (a tie, such as two zero scores, is no evidence that it helps);
the calibration stores it (``routing.calibration``), and the calibrated weighting scales ``lambda``
by it, so a client whose local adapter did not help is served the global adapter. Only the client's
own examples enter, on its own node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adapters.generation import GenerationConfig, generate
from training.data import PromptConfig, Record, prompt_texts
from training.metrics import score
from training.runtime import Runtime

METRIC = "rouge1"


@dataclass(frozen=True)
class GateResult:
    """What a client's check measured.

    Attributes:
        gain: 1.0 to keep ``lambda`` (the mix scored higher than the global alone), 0.0 to serve the global alone.
        lambda_: the local weight checked.
        global_score: ROUGE-1 of the global adapter alone on the held-out examples (x 100).
        mixed_score: ROUGE-1 of ``(1 - lambda, lambda)`` over (global, local).
        n: held-out examples scored.
    """

    gain: float
    lambda_: float
    global_score: float
    mixed_score: float
    n: int

    def asdict(self) -> dict[str, Any]:
        """The calibration's ``gate`` record."""
        return {"metric": METRIC, "lambda": self.lambda_, "global": self.global_score, "mixed": self.mixed_score,
                "n": self.n, "gain": self.gain}


def check_local(rt: Runtime, examples: Sequence[Record], lambda_: float,
                max_new_tokens: int = GenerationConfig.max_new_tokens, batch_size: int = 8) -> GateResult:
    """Score ``examples`` with the global adapter alone and mixed with the local one at ``lambda_``.

    Args:
        rt: the runtime with the client's ``global`` and ``local`` adapters loaded.
        examples: the client's held-out examples (prompted with the run's template).
        lambda_: the local adapter's weight in the mix (FedDPA's lambda), in (0, 1].
        max_new_tokens: greedy tokens per answer (default: ``fedmosaic eval``'s, the generation default).
        batch_size: prompts per ``generate`` batch.

    Raises:
        ValueError: no examples, or ``lambda_`` outside (0, 1].
    """
    if not examples:
        raise ValueError("the local adapter's check needs held-out examples")
    if not 0.0 < lambda_ <= 1.0:
        raise ValueError(f"the local weight to check must be in (0, 1], got {lambda_}")
    prompts = prompt_texts(examples, rt.tokenizer, PromptConfig(rt.train.prompt_style))
    references = [r.output for r in examples]
    config = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch_size)
    results = []
    for w in (0.0, float(lambda_)):
        answers = generate(rt.adapted, rt.model, rt.tokenizer, prompts, ("global", "local"), [1.0 - w, w], config,
                           autocast=rt.loaded.autocast)
        results.append(score(answers, references).get(METRIC))
    base, mixed = results
    return GateResult(1.0 if mixed > base else 0.0, float(lambda_), base, mixed, len(examples))
