"""Linear CKA (Kornblith et al. 2019), the representation similarity FedMCP's loss uses (paper 004).

For representations X (n, p) and Y (n, q) of the same n examples, with column-centred X~, Y~:

    CKA(X, Y) = ||Y~^T X~||_F^2 / (||X~^T X~||_F ||Y~^T Y~||_F)      (in [0, 1])

equal to HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with linear kernels K = X X^T, L = Y Y^T.
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
