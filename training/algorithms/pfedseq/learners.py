"""pFedSeq's sequential learners: selective SSM (the paper's), LSTM and MLP (its ablations E and D).

Every learner maps a window of update steps to one calibration per client (paper 003 eqs 2 and 6;
docs/methods.md 4.2): input ``[b, l, N]`` with the adapter coordinates as the batch ``b``, the rounds as the
sequence ``l`` and the clients as the channels ``N``; output ``[b, N]``, the last step only. The size of a
learner depends on N (and L for the MLP), never on the adapter size.

All three read out a residual stream whose last step starts as the newest update: the SSM and LSTM
learners are pre-norm residual stacks (Gu & Dao's block layout, 2 layers), and the MLP learner adds its
network's output to the newest step, so the ablation compares only the sequence model.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from training.algorithms.pfedseq.ssm import MambaBlock, ResidualStack

LearnerKind = Literal["ssm", "lstm", "mlp"]
KINDS: tuple[str, ...] = ("ssm", "lstm", "mlp")


class SeqLearner(nn.Module):
    """Common interface: ``forward(x [b, l, N]) -> [b, N]`` (the calibration read at the last step)."""

    kind: str = ""

    def __init__(self, n_clients: int, window: int) -> None:
        super().__init__()
        if n_clients < 1 or window < 1:
            raise ValueError(f"a sequential learner needs n_clients >= 1 and window >= 1, got {n_clients}, {window}")
        self.n_clients, self.window = n_clients, window

    def check(self, x: torch.Tensor) -> None:
        """Raise ValueError unless ``x`` is ``[b, l, N]`` with ``1 <= l``."""
        if x.dim() != 3 or x.shape[-1] != self.n_clients or x.shape[1] < 1:
            raise ValueError(f"{self.kind} learner expects [batch, steps>=1, {self.n_clients}], got {tuple(x.shape)}")


class SSMLearner(SeqLearner):
    """Stacked Mamba blocks (paper default: 2 layers, state 16, expand 2, conv kernel 4)."""

    kind = "ssm"

    def __init__(self, n_clients: int, window: int, layers: int = 2, d_state: int = 16, expand: int = 2,
                 d_conv: int = 4, backend: str = "auto") -> None:
        super().__init__(n_clients, window)
        blocks: list[nn.Module] = [MambaBlock(n_clients, d_state, expand, d_conv, backend) for _ in range(layers)]
        self.stack = ResidualStack(blocks, n_clients)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        return self.stack(x)[:, -1]


class _LSTMMixer(nn.Module):
    """An LSTM over the steps (hidden ``expand * N``) projected back to N channels."""

    def __init__(self, d_model: int, expand: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_model, expand * d_model, batch_first=True)
        self.out_proj = nn.Linear(expand * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.lstm(x)[0])


class LSTMLearner(SeqLearner):
    """Ablation E: the same residual stack with an LSTM in place of each Mamba mixer."""

    kind = "lstm"

    def __init__(self, n_clients: int, window: int, layers: int = 2, expand: int = 2) -> None:
        super().__init__(n_clients, window)
        self.stack = ResidualStack([_LSTMMixer(n_clients, expand) for _ in range(layers)], n_clients)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        return self.stack(x)[:, -1]


class MLPLearner(SeqLearner):
    """Ablation D: an MLP on the N*L concatenated steps (pFedHN-style, hidden 100); fixed length L.

    A window shorter than L (the first rounds) is left-padded with zero updates.
    """

    kind = "mlp"

    def __init__(self, n_clients: int, window: int, hidden: int = 100, depth: int = 4) -> None:
        super().__init__(n_clients, window)
        if depth < 1 or hidden < 1:
            raise ValueError(f"MLP learner needs depth >= 1 and hidden >= 1, got {depth}, {hidden}")
        sizes = [n_clients * window] + [hidden] * (depth - 1) + [n_clients]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        if x.shape[1] > self.window:
            raise ValueError(f"MLP learner takes at most {self.window} steps, got {x.shape[1]}")
        padded = F.pad(x, (0, 0, self.window - x.shape[1], 0))  # [b, L, N], zeros before the first round
        return x[:, -1] + self.net(padded.flatten(1))


def make_learner(kind: str, n_clients: int, window: int, *, layers: int = 2, d_state: int = 16, expand: int = 2,
                 d_conv: int = 4, hidden: int = 100, backend: str = "auto") -> SeqLearner:
    """Build a learner by name (``ssm`` default, ``lstm``, ``mlp``).

    Raises:
        ValueError: unknown ``kind`` or invalid sizes.
    """
    if kind == "ssm":
        return SSMLearner(n_clients, window, layers, d_state, expand, d_conv, backend)
    if kind == "lstm":
        return LSTMLearner(n_clients, window, layers, expand)
    if kind == "mlp":
        return MLPLearner(n_clients, window, hidden)
    raise ValueError(f"unknown learner {kind!r}; learners: {list(KINDS)}")


class OwnSequence(nn.Module):
    """pFedSeq ablation C: a single-channel learner run on each client's update sequence alone.

    ``forward(x [b, l, N]) -> [b, N]`` like every learner, but no client sees another's updates: the N
    clients become N batch rows of one channel (the weights are shared by the clients).
    """

    def __init__(self, learner: SeqLearner) -> None:
        super().__init__()
        self.learner = learner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, n = x.shape
        own = x.permute(0, 2, 1).reshape(b * n, length, 1)  # [b*N, l, 1]
        return self.learner(own).reshape(b, n)

