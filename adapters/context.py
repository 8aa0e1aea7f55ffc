"""The one contract: per-row or per-token adapter weights, set once per forward for every layer.

Every adapted Linear computes ``y = W0 x + sum_k w[k] * s_k * B_k A_k x`` (ARCHITECTURE.md, "The one
contract"). The trainer or the engine states ``w`` for the whole model in one place, an
:class:`AdapterContext` shared by all adapted layers (vLLM's per-step mapping object), instead of
threading arguments through every layer:

    names, weights = weight_matrix([(("global", "alice:local"), (0.6, 0.4)), ((), ())])  # (B, K)
    with adapted.context.use(names, weights):     # or (B, T, K) per token
        logits = model(input_ids).logits

A one-hot row is a single adapter, a zero row the base model. FedDPA is ``(1 - a_b, a_b)`` over
(global, local). Weights a layer computes itself, per token, come through a :class:`TokenRouting`
hook instead (AMoLE's gate over a client's experts, :mod:`adapters.amole_routing`), which the layer
calls without knowing what it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from adapters.config import AdapterError


@runtime_checkable
class TokenRouting(Protocol):
    """A per-token router every adapted layer runs on its input (e.g. AMoLE's gate, paper 002 section 4.2).

    Attributes:
        rows: the batch rows it describes.
    """

    @property
    def rows(self) -> int: ...

    def forward(self, layer: Any, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """Return ``result`` (the frozen layer's output for ``x``) plus the routed update of ``layer``."""
        ...


def weight_matrix(rows: Sequence[tuple[Sequence[str], Sequence[float]]], device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[tuple[str, ...], torch.Tensor]:
    """The one builder of a batch's weights: the union of the rows' adapters and the ``(B, K)`` matrix.

    Args:
        rows: per batch row, its adapter names and their weights (empty for the base model).
        device: where the matrix goes (the model's device: one copy, not one per forward).
        dtype: its dtype.

    Returns:
        ``(names, weights)``: names in first-use order; a row has zero weight for adapters it did not name.

    Raises:
        AdapterError: a row repeats an adapter or gives a different number of names and weights.
    """
    index: dict[str, int] = {}
    for names, weights in rows:
        if len(names) != len(weights) or len(set(names)) != len(names):
            raise AdapterError(f"a row needs unique adapter names and one weight each, got {names} and {weights}")
        for name in names:
            index.setdefault(name, len(index))
    matrix = [[0.0] * len(index) for _ in rows]  # filled on the host, copied once
    for row, (names, weights) in zip(matrix, rows, strict=True):
        for name, w in zip(names, weights, strict=True):
            row[index[name]] = float(w)
    return tuple(index), torch.tensor(matrix, dtype=dtype).reshape(len(rows), len(index)).to(device)


@dataclass(frozen=True)
class AdapterWeights:
    """Which adapters apply to the current batch, and how much, row by row.

    Attributes:
        names: adapter slot names, K of them, in the order of the last weights axis.
        weights: ``(B, K)`` per batch row or ``(B, T, K)`` per token; finite (checked for CPU tensors).
        trainable: adapters that receive gradients in this forward; the others contribute detached
            (FedDPA-T trains the local adapter beside the frozen global). None: every adapter
            follows its parameters' ``requires_grad``.
        routing: a per-token router every layer also runs (rows it routes have zero rows here).
        row: the one weight row that every batch row uses, on the host (K floats), or None. The trainer's
            case (:meth:`AdapterContext.uniform`): the layers read it instead of ``weights``, so a forward
            never reads a tensor's values (no device sync, no graph break under ``torch.compile``).
    """

    names: tuple[str, ...]
    weights: torch.Tensor
    trainable: frozenset[str] | None = None
    routing: TokenRouting | None = None
    row: tuple[float, ...] | None = None
    # Per-forward memo shared by every layer: which adapters are dense or gathered, the gather
    # indices and coefficients. Computed by the first layer, reused by the other 59 (decode steps
    # are dominated by this bookkeeping otherwise).
    plans: dict[tuple[object, ...], object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names):
            raise AdapterError(f"adapter names in one forward must be unique, got {self.names}")
        if not isinstance(self.weights, torch.Tensor):
            raise AdapterError(f"adapter weights must be a torch.Tensor, got {type(self.weights).__name__}")
        if self.weights.dim() not in (2, 3):
            raise AdapterError(
                f"adapter weights must have shape (B, K) or (B, T, K), got {tuple(self.weights.shape)}"
            )
        if self.weights.shape[-1] != len(self.names):
            raise AdapterError(
                f"adapter weights have {self.weights.shape[-1]} columns for {len(self.names)} "
                f"adapters {self.names}"
            )
        # Checked where it costs nothing: reading a GPU tensor's values would wait for the GPU on every
        # forward. Weights built on a device come from already-checked numbers (routing, the trainer).
        if self.weights.device.type == "cpu" and not torch.isfinite(self.weights).all():
            raise AdapterError("adapter weights contain NaN or inf")
        if self.row is not None and (len(self.row) != len(self.names) or self.weights.shape[0] != 1
                                     or self.per_token):
            raise AdapterError(f"a shared weight row needs {len(self.names)} weights and (1, K) weights, got "
                               f"{self.row} and {tuple(self.weights.shape)}")
        if self.trainable is not None:
            unknown = set(self.trainable) - set(self.names)
            if unknown:
                raise AdapterError(f"trainable adapters {sorted(unknown)} are not among {self.names}")

    @property
    def per_token(self) -> bool:
        """True for ``(B, T, K)`` weights."""
        return self.weights.dim() == 3

    def rows(self) -> int:
        """Number of batch rows B the weights describe."""
        if self.routing is not None:
            return int(self.routing.rows)
        return int(self.weights.shape[0])


class AdapterContext:
    """Holds the :class:`AdapterWeights` of the forward in progress; read by every adapted layer."""

    def __init__(self) -> None:
        self._stack: list[AdapterWeights] = []

    @property
    def current(self) -> AdapterWeights | None:
        """The innermost active weights, or None (every layer runs the base model alone)."""
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def use(
        self,
        names: Sequence[str],
        weights: torch.Tensor | Sequence[Sequence[float]],
        trainable: Sequence[str] | None = None,
    ) -> Iterator[AdapterWeights]:
        """Apply ``weights`` over adapters ``names`` to every forward inside the block.

        Args:
            names: K adapter names (slots).
            weights: ``(B, K)`` or ``(B, T, K)``; a nested list is converted to a float32 CPU tensor. The
                layers copy CPU weights to the activations' device once per forward; weights created on
                the model's device skip that copy.
            trainable: adapters that get gradients; the others are detached. None: all.

        Yields:
            The validated :class:`AdapterWeights`.
        """
        tensor = weights if isinstance(weights, torch.Tensor) else torch.tensor(weights, dtype=torch.float32)
        state = AdapterWeights(
            names=tuple(names),
            weights=tensor,
            trainable=None if trainable is None else frozenset(trainable),
        )
        with self._entered(state):
            yield state

    @contextlib.contextmanager
    def uniform(
        self,
        names: Sequence[str],
        weights: Sequence[float],
        trainable: Sequence[str] | None = None,
    ) -> Iterator[AdapterWeights]:
        """Apply the same ``weights`` to every row of every forward inside the block (local training).

        The weights stay Python floats that each layer reads on the host: an adapter at weight 0 is
        skipped, the others take the dense path whatever the batch size. Nothing waits for the device,
        and a compiled decoder layer (``TrainConfig.compile``) traces it without a graph break.

        Args:
            names: K adapter names (slots).
            weights: their K finite weights.
            trainable: adapters that get gradients; the others are detached. None: all.

        Yields:
            The validated :class:`AdapterWeights` (its ``weights`` the ``(1, K)`` row).
        """
        try:
            row = tuple(float(w) for w in weights)
        except (TypeError, ValueError, OverflowError) as exc:
            raise AdapterError(f"adapter weights must be {len(names)} finite numbers, got {weights!r}: {exc}") from exc
        state = AdapterWeights(
            names=tuple(names),
            weights=torch.tensor([row], dtype=torch.float32).reshape(1, len(row)),
            trainable=None if trainable is None else frozenset(trainable),
            row=row,
        )
        with self._entered(state):
            yield state

    @contextlib.contextmanager
    def route_tokens(
        self,
        routing: TokenRouting,
        names: Sequence[str] = (),
        weights: torch.Tensor | None = None,
    ) -> Iterator[TokenRouting]:
        """Run a per-token router in every adapted layer inside the block (AMoLE's client routing).

        Args:
            routing: the batch's router (e.g. :class:`adapters.amole_routing.AMoLERouting`).
            names: optional adapters applied beside it with per-row weights (rows the router does not
                route use them, so a served batch mixes routed clients, plain adapters and the base model).
            weights: ``(B, K)`` weights over ``names``; zero rows for routed rows.
        """
        tensor = weights if weights is not None else torch.zeros(routing.rows, len(names))
        with self._entered(AdapterWeights(names=tuple(names), weights=tensor, routing=routing)):
            yield routing

    @contextlib.contextmanager
    def single(self, name: str, batch: int, trainable: bool = True) -> Iterator[AdapterWeights]:
        """Apply one adapter at weight 1 to all ``batch`` rows."""
        with self.use((name,), torch.ones(batch, 1), trainable=(name,) if trainable else ()) as state:
            yield state

    @contextlib.contextmanager
    def base(self) -> Iterator[None]:
        """Run the base model alone inside the block, whatever an outer block set."""
        with self._entered(AdapterWeights(names=(), weights=torch.zeros(1, 0))):
            yield

    @contextlib.contextmanager
    def _entered(self, state: AdapterWeights) -> Iterator[None]:
        """``state`` is the current weights inside the block, whatever the block raises."""
        self._stack.append(state)
        try:
            yield
        finally:
            self._stack.pop()
