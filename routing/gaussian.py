"""A shrunk Gaussian model of one client's final-layer states: the Mahalanobis score of calibrated FedDPA.

The calibrated weighting (:mod:`routing.calibration`) asks how typical a prompt's state is of a client's
own instances (paper 000 section 4.3 compares it with them by cosine). A mean cosine only looks along
the direction of the client's mean; prompts of another task that lie along that direction but off the
client's own spread score as high as the client's own prompts. A Gaussian fitted to the client's
instances scores the whole offset: ``d2(x) = (x - mu)^T Sigma^-1 (x - mu)``, the squared Mahalanobis
distance, the usual out-of-distribution score on hidden states (Lee et al., NeurIPS 2018). The
covariance of N instances in H dimensions is singular when N <= H, so it is shrunk towards a scaled
identity, ``(1 - g) S + g (tr S / H) I``, with the Ledoit-Wolf estimate of ``g`` (J. Multivariate
Analysis 88, 2004), computed from the instances themselves.

Only the client's own vectors enter the fit; the fit is a pure function of them and ``g``, so a server
recomputes it from the index when it loads a client instead of storing an (H, H) matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from routing.base import RoutingError


def ledoit_wolf_shrinkage(vectors: np.ndarray) -> float:
    """The Ledoit-Wolf shrinkage intensity of ``vectors`` (N, H) towards ``(tr S / H) I``, in [0, 1].

    ``S`` is the maximum-likelihood covariance (divided by N). The estimate is
    ``min(b2, d2) / d2`` with ``d2 = ||S - m I||_F^2`` and ``b2 = (1/N^2) sum_k ||z_k z_k^T - S||_F^2``.
    Identical vectors (``d2 = 0``) give 1.
    """
    x = np.asarray(vectors, dtype=np.float64)
    n, h = x.shape
    z = x - x.mean(axis=0)
    norms = (z * z).sum(axis=1)  # (N,)
    trace = float(norms.sum()) / n
    m = trace / h
    if n <= h:  # every term from the (N, N) Gram matrix: ||S||_F = ||Z Z^T||_F / N, z_k^T S z_k = sum_j G_kj^2 / N
        gram = z @ z.T
        s_sq = float((gram * gram).sum()) / n ** 2
        quad = float((gram * gram).sum()) / n
    else:
        s = z.T @ z / n  # (H, H)
        s_sq = float((s * s).sum())
        quad = float(np.einsum("nh,hk,nk->", z, s, z))
    d2 = s_sq - 2.0 * m * trace + m * m * h  # ||S - m I||_F^2
    if d2 <= 1e-12 * max(s_sq, 1e-300):
        return 1.0
    # ||z z^T - S||_F^2 = ||z||^4 - 2 z^T S z + ||S||_F^2, summed over the N rows
    b2 = (float((norms ** 2).sum()) - 2.0 * quad + n * s_sq) / n ** 2
    return float(min(max(b2, 0.0), d2) / d2)


@dataclass(frozen=True, eq=False)
class Gaussian:
    """A fitted shrunk Gaussian, kept in the span of its instances plus an isotropic floor.

    With ``S = V diag(e) V^T`` (V: the R <= min(N, H) principal directions of the centred instances),
    ``Sigma = V diag((1 - g) e + f) V^T + f (I - V V^T)`` with ``f = g tr(S) / H``, so
    ``d2(x) = (||z||^2 - ||V^T z||^2) / f + sum_i (v_i . z)^2 / ((1 - g) e_i + f)``, ``z = x - mean``:
    O(R H) per query and no (H, H) matrix. Float64 throughout (the two terms can be large).

    Attributes:
        mean: (H,) the instances' mean.
        basis: (R, H) orthonormal principal directions.
        inverse: (R,) ``1 / ((1 - g) e_i + f)``.
        floor: ``f``, the variance outside the span (and the shrinkage's floor inside it).
        shrinkage: the ``g`` used.
    """

    mean: np.ndarray
    basis: np.ndarray
    inverse: np.ndarray
    floor: float
    shrinkage: float

    @classmethod
    def fit(cls, vectors: np.ndarray, shrinkage: float | None = None) -> Gaussian:
        """Fit to ``vectors`` (N, H), N >= 1; ``shrinkage`` None: the Ledoit-Wolf estimate.

        Raises:
            RoutingError: not a finite non-empty (N, H) array, or a shrinkage outside [0, 1].
        """
        x = np.asarray(vectors, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1 or not np.isfinite(x).all():
            raise RoutingError(f"a Gaussian needs a finite non-empty (N, H) array, got shape {x.shape}")
        g = ledoit_wolf_shrinkage(x) if shrinkage is None else float(shrinkage)
        if not 0.0 <= g <= 1.0:
            raise RoutingError(f"shrinkage must be in [0, 1], got {shrinkage}")
        n, h = x.shape
        mean = x.mean(axis=0)
        basis, values = _principal(x - mean)
        g = max(g, 1e-6)  # S alone is singular whenever N <= H
        # the identity target's scale; a floor keeps a fit of identical vectors invertible
        scale = max(float(values.sum()) / h, 1e-12 * max(float((x * x).sum()) / (n * h), 1.0))
        floor = g * scale
        return cls(mean, np.ascontiguousarray(basis), 1.0 / ((1.0 - g) * values + floor), floor, g)

    def sq_distance(self, queries: np.ndarray) -> np.ndarray:
        """Squared Mahalanobis distances of ``queries`` (Q, H) or (H,): (Q,) or a scalar array."""
        z = np.asarray(queries, dtype=np.float64) - self.mean
        p = z @ self.basis.T  # (Q, R)
        outside = np.maximum((z * z).sum(axis=-1) - (p * p).sum(axis=-1), 0.0)
        return outside / self.floor + (p * p * self.inverse).sum(axis=-1)


def _principal(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal principal directions (R, H) of centred rows ``z`` (N, H) and the eigenvalues (R,) of ``z^T z / N``.

    Through the (N, N) Gram matrix when N <= H (an index is usually a few hundred instances of a wider
    state), else the (H, H) covariance; directions of zero variance are dropped.
    """
    n, h = z.shape
    if n <= h:
        w, u = np.linalg.eigh(z @ z.T)
        keep = w > 1e-12 * max(float(w.max()), 1e-300)
        basis = (z.T @ (u[:, keep] / np.sqrt(w[keep]))).T
        return np.ascontiguousarray(basis), w[keep] / n
    w, v = np.linalg.eigh(z.T @ z / n)
    keep = w > 1e-12 * max(float(w.max()), 1e-300)
    return np.ascontiguousarray(v[:, keep].T), w[keep]


def held_out_sq_distances(vectors: np.ndarray, shrinkage: float, folds: int = 5, seed: int = 0) -> np.ndarray:
    """Each instance's squared distance under a Gaussian fitted without it (``folds``-fold), (N,).

    A client's own prompts at serving time are not in its index, so its reference level must come from
    instances the fit has not seen; in-sample distances would be too small. Fewer than ``folds``
    instances: leave-one-out. The folds are a seeded permutation, so a calibration is reproducible.
    """
    x = np.asarray(vectors, dtype=np.float32)
    n = len(x)
    if n < 2:
        raise RoutingError("held-out distances need at least 2 instances")
    k = min(folds, n)
    order = np.random.default_rng(seed).permutation(n)
    out = np.empty(n, dtype=np.float32)
    for f in range(k):
        test = order[f::k]
        train = np.setdiff1d(order, test)
        out[test] = Gaussian.fit(x[train], shrinkage).sq_distance(x[test])
    return out
