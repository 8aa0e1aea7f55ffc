"""Sequence representations used by regularisers: last non-pad token and masked mean pooling.

FedOA (paper 001, section 4; docs/methods.md 3.1) compares the final-layer state of the last token; FedMCP
(paper 004, section 3) mean-pools the final-layer token states. Both read HF ``hidden_states[-1]``.
"""

from __future__ import annotations

import torch


def last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) states -> (B, H) at each row's last non-pad position (left or right padding)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = (positions * mask.long()).argmax(dim=1)  # (B,)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) states -> (B, H) mean over non-pad positions."""
    m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def feature_distance(a: torch.Tensor, b: torch.Tensor, kind: str = "l2") -> torch.Tensor:
    """FedOA's distance between (B, H) feature batches.

    ``l2``: the Frobenius norm of the difference over the whole batch, not squared, not averaged (the
    reference's ``torch.dist``); ``cosine``: mean of 1 - cos; ``pearson``: mean of 1 - Pearson r.
    """
    a, b = a.float(), b.float()
    if kind == "l2":
        return torch.dist(a, b, p=2)
    if kind == "cosine":
        return (1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).mean()
    if kind == "pearson":
        a = a - a.mean(dim=-1, keepdim=True)
        b = b - b.mean(dim=-1, keepdim=True)
        return (1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).mean()
    raise ValueError(f"distance must be 'l2', 'cosine' or 'pearson', got {kind!r}")
