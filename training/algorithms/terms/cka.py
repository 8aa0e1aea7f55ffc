"""Linear CKA (Kornblith et al. 2019), the representation similarity FedMCP's loss uses (paper 004).

For representations X (n, p) and Y (n, q) of the same n examples, with column-centred X~, Y~:

    CKA(X, Y) = ||Y~^T X~||_F^2 / (||X~^T X~||_F ||Y~^T Y~||_F)      (in [0, 1])

equal to HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with linear kernels K = X X^T, L = Y Y^T, and its
debiased form (:func:`unbiased_linear_cka`, the same ratio of unbiased HSIC estimates), which FedMCP uses
by default because the plain one is near 1 for any two batches of few rows in a wide space.
"""

from __future__ import annotations

import torch


def linear_cka(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Linear CKA between (n, p) and (n, q) representations (differentiable, fp32).

    Raises:
        ValueError: different numbers of rows, or fewer than 2 (CKA needs a centred sample).
    """
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same examples on both sides, got {x.shape[0]} and {y.shape[0]} rows")
    if x.shape[0] < 2:
        raise ValueError("CKA needs at least 2 examples")
    x = x.float() - x.float().mean(dim=0, keepdim=True)  # (n, p)
    y = y.float() - y.float().mean(dim=0, keepdim=True)  # (n, q)
    cross = (y.T @ x).pow(2).sum()
    return cross / ((x.T @ x).norm() * (y.T @ y).norm() + eps)


def _unbiased_hsic(k: torch.Tensor, l: torch.Tensor) -> torch.Tensor:  # noqa: E741 - the paper's names
    """Song et al. (2012)'s unbiased HSIC estimator of (n, n) Gram matrices (their diagonals are ignored)."""
    n = k.shape[0]
    k = k - torch.diag_embed(torch.diagonal(k))
    l = l - torch.diag_embed(torch.diagonal(l))  # noqa: E741
    ones = torch.ones(n, 1, dtype=k.dtype, device=k.device)
    trace = (k * l).sum()  # tr(K L) for symmetric K, L
    middle = (ones.T @ k @ ones) * (ones.T @ l @ ones) / ((n - 1) * (n - 2))
    cross = (ones.T @ k @ l @ ones) * 2 / (n - 2)
    return ((trace + middle - cross) / (n * (n - 3))).squeeze()


def unbiased_linear_cka(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Linear CKA with the unbiased HSIC estimator (Song et al. 2012; Nguyen et al. 2021's "debiased" CKA).

    The plain estimator is biased upward on few samples (two unrelated (8, 576) batches score far above 0),
    so its value, and FedMCP's contrast term, would change with the batch size a budget imposes; this one
    is unbiased for each HSIC (the ratio still has a small bias) and can be slightly negative.

    Raises:
        ValueError: different numbers of rows, or fewer than 4 (the estimator divides by n - 3).
    """
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same examples on both sides, got {x.shape[0]} and {y.shape[0]} rows")
    if x.shape[0] < 4:
        raise ValueError("unbiased CKA needs at least 4 examples")
    # float64: the estimator subtracts sums of the same size (n x n is small); the estimate is
    # translation-invariant, so centring first only keeps the round-off smaller still
    x = x.double() - x.double().mean(dim=0, keepdim=True)  # (n, p)
    y = y.double() - y.double().mean(dim=0, keepdim=True)  # (n, q)
    k, l = x @ x.T, y @ y.T  # noqa: E741 - (n, n) linear kernels
    den = (_unbiased_hsic(k, k).clamp_min(0) * _unbiased_hsic(l, l).clamp_min(0)).sqrt()
    return (_unbiased_hsic(k, l) / (den + eps)).float()
