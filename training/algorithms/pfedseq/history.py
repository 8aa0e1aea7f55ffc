"""pFedSeq's server memory and the chunked learner passes over it (paper 003 eqs 2, 5, 6; docs/methods.md 4.1-4.2).

The adapter is flattened once into one vector of D coordinates, ordered by backbone layer, so that each
layer's coordinates form a contiguous group with its own learner (paper: one learner per backbone
layer). The history keeps the last L update steps, each ``[N, D]`` (a client absent from a round
contributes a zero update). A learner sees a group as a batch of coordinates (``[b, l, N]``); since it
acts on every coordinate independently, the coordinates are processed in chunks of a fixed size, so
memory stays bounded for any adapter size (paper Appendix A) and the result does not depend on the
chunk size: outputs are written chunk by chunk, and the proxy gradient
``sum_i (d xi_i / d psi)^T (-Delta_i)`` (pFedHN's convention) is accumulated into ``.grad`` chunk by
chunk before the single optimizer step.

Each group's window is divided by its RMS before the learner and the output multiplied back, so the
learner works in units of the updates whatever the adapter's scale (the paper does not state one;
LoRA updates are ~1e-4 while the learner's norms assume unit inputs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from training.state import StateDict

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _natural(key: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


@dataclass(frozen=True)
class Layout:
    """How adapter tensors map onto the flat vector and its per-layer groups.

    Attributes:
        keys: the state keys in flat order (by backbone layer, then name).
        shapes: each key's shape.
        groups: ``(name, start, end)`` slices of the flat vector, one per backbone layer.
    """

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[str, int, int], ...]

    @classmethod
    def from_state(cls, state: Mapping[str, torch.Tensor]) -> Layout:
        """Group ``state``'s keys by their ``layers.<i>.`` prefix (keys outside layers form one group)."""
        if not state:
            raise ValueError("pFedSeq needs a non-empty adapter state to lay out")

        def group_of(key: str) -> tuple[float, str]:
            m = _LAYER.search(key)
            return (int(m.group(1)), key[: m.end() - 1]) if m else (math.inf, "other")

        keys = sorted(state, key=lambda k: (group_of(k)[0], _natural(k)))
        groups: list[tuple[str, int, int]] = []
        offset = 0
        for key in keys:
            name, n = group_of(key)[1], state[key].numel()
            if groups and groups[-1][0] == name:
                groups[-1] = (name, groups[-1][1], offset + n)
            else:
                groups.append((name, offset, offset + n))
            offset += n
        return cls(tuple(keys), tuple(tuple(state[k].shape) for k in keys), tuple(groups))

    @property
    def size(self) -> int:
        """D, the number of adapter coordinates."""
        return self.groups[-1][2]

    def flatten(self, state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
        """``state`` as a float32 vector ``[D]`` in layout order.

        Raises:
            ValueError: the keys or shapes differ from the layout's.
        """
        if set(state) != set(self.keys):
            diff = sorted(set(state) ^ set(self.keys))[:3]
            raise ValueError(f"adapter keys differ from pFedSeq's layout (e.g. {diff})")
        for key, shape in zip(self.keys, self.shapes, strict=True):
            if tuple(state[key].shape) != shape:
                raise ValueError(f"{key}: shape {tuple(state[key].shape)} differs from the layout's {shape}")
        return torch.cat([state[k].detach().reshape(-1).to(device=device, dtype=torch.float32) for k in self.keys])

    def unflatten(self, vec: torch.Tensor) -> StateDict:
        """Inverse of :meth:`flatten` (CPU float32 tensors)."""
        out: StateDict = {}
        offset = 0
        flat = vec.detach().cpu()
        for key, shape in zip(self.keys, self.shapes, strict=True):
            n = math.prod(shape)
            out[key] = flat[offset:offset + n].reshape(shape).clone()
            offset += n
        return out

    def asdict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"keys": list(self.keys), "shapes": [list(s) for s in self.shapes],
                "groups": [list(g) for g in self.groups]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of :meth:`asdict`."""
        return cls(tuple(data["keys"]), tuple(tuple(s) for s in data["shapes"]),
                   tuple((str(g[0]), int(g[1]), int(g[2])) for g in data["groups"]))


class UpdateHistory:
    """The last ``maxlen`` update steps ``Delta^j`` (each ``[N, D]``), oldest first."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"pFedSeq window L must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self.steps: list[torch.Tensor] = []

    def push(self, step: torch.Tensor) -> None:
        """Append one round's updates, dropping the oldest beyond ``maxlen``."""
        if self.steps and step.shape != self.steps[-1].shape:
            raise ValueError(f"update step shape {tuple(step.shape)} differs from {tuple(self.steps[-1].shape)}")
        self.steps = [*self.steps, step][-self.maxlen:]

    def load(self, steps: Sequence[torch.Tensor]) -> None:
        """Replace the history with checkpointed ``steps`` (oldest first, each ``[N, D]``).

        Raises:
            ValueError: more steps than ``maxlen`` (a checkpoint of a longer window), or unequal shapes.
        """
        if len(steps) > self.maxlen:
            raise ValueError(f"checkpoint holds {len(steps)} update steps, more than the window L = {self.maxlen}")
        shapes = {tuple(s.shape) for s in steps}
        if len(shapes) > 1 or any(len(s) != 2 for s in shapes):
            raise ValueError(f"checkpointed update steps must share one [N, D] shape, got {sorted(shapes)}")
        self.steps = list(steps)

    def __len__(self) -> int:
        return len(self.steps)


def window_scale(window: Sequence[torch.Tensor], start: int, end: int) -> float:
    """RMS of one group's entries over the window (every client and step); 1.0 for an all-zero window."""
    total = sum(float(w[:, start:end].double().pow(2).sum()) for w in window)
    rms = math.sqrt(total / (len(window) * window[0].shape[0] * (end - start)))
    return rms if rms > 0 else 1.0


def _inputs(window: Sequence[torch.Tensor], start: int, end: int, scale: float) -> torch.Tensor:
    # [l, N, c] -> [c, l, N]: coordinates are the batch, rounds the sequence, clients the channels
    return torch.stack([w[:, start:end] for w in window]).permute(2, 0, 1).contiguous() / scale


def _chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    if chunk < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk}")
    return [(a, min(a + chunk, end)) for a in range(start, end, chunk)]


def calibrate(learner: nn.Module, window: Sequence[torch.Tensor], start: int, end: int,
              chunk: int) -> torch.Tensor:
    """The learner's calibrations ``xi`` for coordinates ``[start, end)``: ``[N, end - start]`` (no grad)."""
    scale = window_scale(window, start, end)
    out = torch.empty(window[0].shape[0], end - start, device=window[0].device)
    with torch.no_grad():
        for a, b in _chunks(start, end, chunk):
            out[:, a - start:b - start] = (learner(_inputs(window, a, b, scale)) * scale).t()
    return out


def accumulate_proxy_grad(learner: nn.Module, window: Sequence[torch.Tensor], updates: torch.Tensor,
                          start: int, end: int, chunk: int) -> None:
    """Add ``sum_i (d xi_i / d psi)^T (-updates_i)`` over ``[start, end)`` into the learner's ``.grad``.

    ``updates`` (``[N, end - start]``) stands in for ``-dL/dxi`` (the clients' new updates from the
    calibrated adapters), so a descent step on the accumulated gradient moves the calibration along them.
    """
    scale = window_scale(window, start, end)
    for a, b in _chunks(start, end, chunk):
        xi = learner(_inputs(window, a, b, scale)) * scale  # [c, N]
        xi.backward(-updates[:, a - start:b - start].t())


def learner_step(learners: Sequence[nn.Module], groups: Sequence[tuple[str, int, int]],
                 window: Sequence[torch.Tensor], updates: torch.Tensor, optimizer: torch.optim.Optimizer,
                 chunk: int, max_grad_norm: float | None = None) -> float:
    """One full-batch step of every group's learner on the previous window (paper eq 5); returns the grad norm.

    Args:
        learners: one learner per group (a SeqLearner, or ablation C's OwnSequence around one).
        groups: ``(name, start, end)`` slices of the flat vector.
        window: the previous window's steps, each ``[N, D]`` (the input that produced the sent calibrations).
        updates: the new updates ``[N, D]`` (gradient proxy).
        optimizer: over every learner's parameters (Adam, lr 1e-3 in the paper).
        chunk: coordinates per pass.
        max_grad_norm: clip each learner's gradient norm (pFedHN clips at 50; the paper states none).
    """
    optimizer.zero_grad(set_to_none=True)
    norms = []
    for learner, (_, start, end) in zip(learners, groups, strict=True):
        accumulate_proxy_grad(learner, window, updates[:, start:end], start, end, chunk)
        params = [p for p in learner.parameters() if p.grad is not None]
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        else:
            grads = [g for p in params if (g := p.grad) is not None]  # all of params' gradients
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return math.sqrt(sum(n * n for n in norms))
