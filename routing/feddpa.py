"""FedDPA instance-wise dynamic weighting of the global and local adapters (paper 000 section 4.3).

For a request with representation ``w_x`` (final-layer last-token state of its prompt with the global
adapter on) and S of its client's local instances ``w_{x_i}``:

    a = lambda * (1/S) * sum_i cos(w_x, w_{x_i}),  clipped to [0, 1]
    weights over (global, local) = (1 - a, a)

The instances come from the client's cached :class:`~routing.cache.EmbeddingIndex`: ``random`` draws S
of them afresh for each request (the paper's estimator), ``knn`` takes the S nearest (deterministic).

``weighting="paper"`` is that rule. ``weighting="calibrated"`` (:mod:`routing.calibration`) scores the
prompt against the client's instances (by default minus its squared Mahalanobis distance to their
shrunk Gaussian; the centred cosine in format-1 calibrations) and maps it with the client's stored
calibration, so a prompt typical of the client's data gets ``lambda`` (times the client's gate: 0 when
its local adapter did no better than the global on held-out examples) and an unrelated one 0; S and
the sampling mode do not apply to it. A client without a calibration is weighted by the paper's rule
(the decision's ``info`` says so).

The reference code (docs/methods.md section 2.4 and section 6 item 4) differs: it embeds with the LOCAL
adapter, does not clip the cosine, and gives ``a`` to the GLOBAL adapter. ``variant="reference"``
reproduces the weight assignment ``(a, 1 - a)``; which adapter is on while embedding is the caller's
choice (``routing.embedding``), and ``clip=False`` drops the clipping.

``similarity`` is paper 000's Table 9 ablation: ``cosine`` (the paper), ``neg_l2`` (minus the Euclidean
distance of the raw states; unbounded below, so with clipping ``a`` is 0 unless the states nearly
coincide, and the paper states no scaling) or ``pearson`` (the cosine of the mean-centred states). In
``knn`` mode the S neighbours are the nearest by cosine; the chosen measure is then taken on them.
``embedding`` is its Table 10 ablation, the pooling of the states (``routing.embedding``: ``last`` token
or ``mean`` over the prompt's tokens); the client's index must hold vectors pooled the same way.

The calibrated weighting replaces the paper's cosine by its own score and is defined for the paper's
assignment (its references are scores of the client's own and of background prompts, mapped so that
the client's own task gets ``lambda`` on its local adapter): combined with another similarity or the
reference variant it is refused (:func:`resolve_weighting`), never silently changed. It composes with
either pooling, since its calibration is computed from the index's own vectors.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Literal, cast

import numpy as np
import torch

from routing.base import GLOBAL, Pooling, RoutingDecision, RoutingError, local_name
from routing.cache import EmbeddingIndex
from routing.embedding import check_pooling

Mode = Literal["random", "knn"]
Variant = Literal["paper", "reference"]
Weighting = Literal["paper", "calibrated"]
WEIGHTINGS: tuple[str, ...] = ("paper", "calibrated")
# The instance-wise rule served and evaluated by default: calibrated separates a client's own task from
# the others where the paper's rule does not (docs/feddpa-weighting.md, measured figures).
DEFAULT_WEIGHTING: Weighting = "calibrated"
Similarity = Literal["cosine", "neg_l2", "pearson"]
SIMILARITIES: tuple[str, ...] = ("cosine", "neg_l2", "pearson")
VARIANTS: tuple[str, ...] = ("paper", "reference")


def similarity_name(text: str) -> Similarity:
    """The similarity a command line or environment names (``neg-l2`` and ``neg_l2`` alike).

    Raises:
        RoutingError: not one of cosine, neg-l2, pearson.
    """
    name = str(text).strip().lower().replace("-", "_")
    if name not in SIMILARITIES:
        raise RoutingError(f"FedDPA similarity must be cosine, neg-l2 or pearson, got {text!r}")
    return cast(Similarity, name)  # one of SIMILARITIES, the values of Similarity


def ablated(similarity: str = "cosine", variant: str = "paper") -> list[str]:
    """The options that leave the paper's rule as the calibrated weighting is defined (empty: none)."""
    return ([f"similarity {similarity!r}"] if similarity != "cosine" else []) + \
        ([f"variant {variant!r}"] if variant != "paper" else [])


def resolve_weighting(rule: str | None, similarity: str = "cosine", variant: str = "paper") -> Weighting:
    """The instance-wise rule to use: ``rule`` as given, or (None) the default one for these options.

    The default is the calibrated rule; with another similarity or the reference variant (ablations of
    the paper's rule, paper 000 Table 9 and the reference code) it is the paper's.

    Raises:
        RoutingError: ``calibrated`` asked for together with such an ablation (one line naming the fix).
    """
    other = ablated(similarity, variant)
    if rule is None:
        return "paper" if other else DEFAULT_WEIGHTING
    if rule not in WEIGHTINGS:
        raise RoutingError(f"FedDPA weighting must be one of {WEIGHTINGS}, got {rule!r}")
    if rule == "calibrated" and other:
        raise RoutingError(f"the calibrated FedDPA weighting is defined for cosine similarity and the paper variant, "
                           f"not {' and '.join(other)}: use --feddpa-weighting paper with it")
    return cast(Weighting, rule)  # one of WEIGHTINGS, the values of Weighting


def similarities(query: np.ndarray, vectors: np.ndarray, kind: Similarity = "cosine") -> np.ndarray:
    """Similarity of ``query`` (H,) to each row of ``vectors`` (S, H) under ``kind`` (float64, (S,))."""
    q, v = query.astype(np.float64), vectors.astype(np.float64)
    if kind == "neg_l2":
        return -np.linalg.norm(v - q, axis=1)
    if kind == "pearson":
        q, v = q - q.mean(), v - v.mean(axis=1, keepdims=True)
    elif kind != "cosine":
        raise RoutingError(f"FedDPA similarity must be cosine, neg_l2 or pearson, got {kind!r}")
    return (v @ q) / np.maximum(np.linalg.norm(v, axis=1) * np.linalg.norm(q), 1e-12)


@dataclass(frozen=True, eq=False)
class FedDPARouter:
    """Per-request (global, local) weights from the similarity of the prompt to local instances.

    Attributes:
        lambda_: scale of the mean cosine (FedDPA-F 1, FedDPA-T its training alpha); >= 0.
        S: local instances compared per request (paper: 5); an index with fewer uses all of them.
        mode: ``random`` (fresh uniform sample per request, the paper) or ``knn`` (the S nearest).
        clip: clip ``a`` to [0, 1] (the paper's score range); False keeps the raw value (reference code).
        seed: seed of the sampling generator (None: fresh OS entropy); ``random`` mode only.
        variant: ``paper`` gives ``a`` to the local adapter, ``reference`` to the global one.
        weighting: ``paper`` (``lambda * mean cosine``) or ``calibrated`` (the calibration's score mapped by
            the client's calibration; ``routing.calibration``).
        similarity: ``cosine`` (paper), ``neg_l2`` or ``pearson`` (paper 000 Table 9's ablation).
        embedding: how the representation and the index's vectors are pooled: ``last`` token (paper) or
            ``mean`` (Table 10); an index pooled otherwise is refused.
    """

    lambda_: float = 1.0
    S: int = 5
    mode: Mode = "random"
    clip: bool = True
    seed: int | None = None
    variant: Variant = "paper"
    weighting: Weighting = "paper"
    similarity: Similarity = "cosine"
    embedding: Pooling = "last"
    _rng: np.random.Generator = field(init=False, repr=False)
    # np.random.Generator is not thread-safe and the HTTP server routes from several threads
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if isinstance(self.lambda_, bool) or not isinstance(self.lambda_, int | float) \
                or not math.isfinite(self.lambda_) or self.lambda_ < 0:
            raise RoutingError(f"FedDPA lambda_ must be a finite number >= 0, got {self.lambda_!r}")
        if isinstance(self.S, bool) or not isinstance(self.S, int) or self.S < 1:
            raise RoutingError(f"FedDPA S (local instances per request) must be an integer >= 1, got {self.S!r}")
        if self.mode not in ("random", "knn"):
            raise RoutingError(f"FedDPA mode must be 'random' or 'knn', got {self.mode!r}")
        if self.variant not in ("paper", "reference"):
            raise RoutingError(f"FedDPA variant must be 'paper' or 'reference', got {self.variant!r}")
        if self.weighting not in WEIGHTINGS:
            raise RoutingError(f"FedDPA weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.similarity not in SIMILARITIES:
            raise RoutingError(f"FedDPA similarity must be cosine, neg_l2 or pearson, got {self.similarity!r}")
        check_pooling(self.embedding)
        resolve_weighting(self.weighting, self.similarity, self.variant)  # refuses calibrated + an ablation
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def decide(
        self, representation: torch.Tensor | np.ndarray, index: EmbeddingIndex,
        generator: np.random.Generator | None = None, client: str = "client",
    ) -> RoutingDecision:
        """Return the FedDPA decision for one request of ``client``.

        Args:
            representation: ``(H,)`` or ``(1, H)`` last-token state of the prompt.
            index: the client's local-instance embeddings.
            generator: sampling generator for this request (e.g. seeded by the request); the
                router's own seeded generator when None.
            client: the requesting client (the decision names its local adapter ``<client>:local``).

        Returns:
            Weights ``(1 - a, a)`` over (``global``, ``<client>:local``) (``(a, 1 - a)`` for the
            reference variant);
            info holds ``weighting``, ``mode``, ``S``, ``S_requested``, ``mean_similarity``, ``lambda``,
            ``a``, ``variant`` and, when the index was smaller than S, a ``note``; a calibrated decision
            holds ``weighting``, ``statistic``, ``score``, ``own``, ``background``, ``lambda``, ``gain`` (the
            client's gate on lambda), ``a``, ``a_before_gate`` (the weight the scores alone give), ``variant``.

        Raises:
            RoutingError: a representation of the wrong width or with NaN/inf, or an index pooled
                otherwise than ``embedding``.
        """
        if index.pooling != self.embedding:
            raise RoutingError(f"client {client!r}'s FedDPA index holds {index.pooling!r} embeddings, the request "
                               f"was pooled {self.embedding!r}; rebuild it with `fedmosaic calibrate RUN_DIR "
                               f"--feddpa-embedding {self.embedding}`")
        q = representation.detach().float().cpu().numpy() if isinstance(representation, torch.Tensor) \
            else np.asarray(representation, dtype=np.float32)
        if q.ndim == 2 and q.shape[0] == 1:
            q = q[0]
        if q.ndim != 1:
            raise RoutingError(f"FedDPA routes one request: representation must be (H,) or (1, H), got {q.shape}")
        if self.weighting == "calibrated" and index.calibration is not None:
            return self._calibrated(q, index, client)
        s = min(self.S, len(index))
        if self.mode == "knn":
            found = index.search(q, s)
            sims, picked = found[0][0], found[1][0]  # (s,)
        elif generator is not None:
            picked = index.sample(s, generator)
            sims = index.cosines(q, picked)
        else:
            with self._lock:
                picked = index.sample(s, self._rng)
            sims = index.cosines(q, picked)  # (s,)
        if self.similarity != "cosine":
            sims = similarities(q, index.raw[picked], self.similarity)
        mean = float(np.mean(sims, dtype=np.float64))
        a = self.lambda_ * mean
        if self.clip:
            a = min(max(a, 0.0), 1.0)
        a_to_local = self.variant == "paper"
        weights = torch.tensor([1.0 - a, a] if a_to_local else [a, 1.0 - a], dtype=torch.float64)
        info: dict[str, object] = {
            "weighting": "paper", "mode": self.mode, "S": s, "S_requested": self.S, "mean_similarity": mean,
            "lambda": float(self.lambda_), "a": a, "variant": self.variant,
        }
        if self.similarity != "cosine":
            info["similarity"] = self.similarity
        if self.embedding != "last":
            info["embedding"] = self.embedding
        if s < self.S:
            info["note"] = f"S={self.S} exceeds the {len(index)} stored instances; used all {len(index)}"
        if self.weighting == "calibrated":
            info["note"] = f"client {client!r} has no calibration (`fedmosaic calibrate RUN_DIR`): the paper's rule"
        return RoutingDecision((GLOBAL, local_name(client)), weights, info)

    def _calibrated(self, q: np.ndarray, index: EmbeddingIndex, client: str) -> RoutingDecision:
        """The calibrated decision: the calibration's score of ``q`` against the client's instances, mapped to ``a``."""
        cal = index.calibration
        assert cal is not None
        if q.shape != (index.dim,) or not np.isfinite(q).all():
            raise RoutingError(f"representation must be a finite ({index.dim},) vector, got shape {q.shape}")
        score = index.calibrated_score(q)
        a, ungated = cal.weight(score, self.lambda_), cal.weight(score, self.lambda_, gated=False)
        if self.clip:
            a, ungated = min(max(a, 0.0), 1.0), min(max(ungated, 0.0), 1.0)
        weights = torch.tensor([1.0 - a, a] if self.variant == "paper" else [a, 1.0 - a], dtype=torch.float64)
        info = {"weighting": "calibrated", "statistic": cal.statistic, "score": score, "own": cal.own,
                "background": cal.background, "lambda": float(self.lambda_), "gain": cal.gain, "a": a,
                "a_before_gate": ungated, "variant": self.variant}
        if self.embedding != "last":
            info["embedding"] = self.embedding
        return RoutingDecision((GLOBAL, local_name(client)), weights, info)
