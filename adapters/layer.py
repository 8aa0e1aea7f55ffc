"""MultiLoraLinear: a frozen ``nn.Linear`` holding any number of named LoRA adapters.

Storage and weighting are apart: the layer stores each adapter's ``A`` (r, d) and ``B`` (o, r)
(LoRA, Hu et al. 2021, section 4.1: A random, B zero at init) and reads the batch's weights from the
shared :class:`~adapters.context.AdapterContext`; the math is in :mod:`adapters.functional`.

Paths, chosen per forward from the weights:
  * an adapter used by every row: one dense matmul over the batch, scaled per row (or token);
  * adapters used by some rows: gathered and applied with ``bmm`` over (row, adapter) pairs;
  * a merged adapter: folded into W0 (no extra cost), refused while other weights are requested.
"""

from __future__ import annotations

import math
from collections.abc import ItemsView
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from adapters.config import AdapterError, LoraConfig
from adapters.context import AdapterContext, AdapterWeights
from adapters.dropout import LoraDropout, lora_dropout_rows
from adapters.functional import gathered_lora_delta, lora_delta, slot_usage, stack_padded, weight_column


@dataclass(frozen=True)
class _Plan:
    """How one forward applies its adapters (identical in every layer holding the same adapters).

    Attributes:
        dense: (slot k, weight column broadcastable to (B, T, 1)) for adapters used by every row.
        gathered: names of adapters used by some rows only.
        rows, local: (N,) the (row, gathered index) pairs; coef (N, 1, 1) or (N, T, 1): weight x scaling.
    """

    dense: list[tuple[int, torch.Tensor]]
    gathered: tuple[str, ...]
    rows: torch.Tensor | None
    local: torch.Tensor | None
    coef: torch.Tensor | None


class LoraAdapter(nn.Module):
    """One adapter's parameters in one layer: ``lora_A`` (r, d) and ``lora_B`` (o, r)."""

    def __init__(self, in_features: int, out_features: int, config: LoraConfig,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        self.scaling = config.scaling
        # fp32 masters on the frozen layer's device; the forward casts them to the activations' dtype
        self.lora_A = nn.Parameter(torch.zeros(config.r, in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, config.r, device=device))
        self.dropout = LoraDropout(config.dropout) if config.dropout > 0 else nn.Identity()

    def reset(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default init: A Kaiming-uniform (a = sqrt(5)), B zero, so the update starts at 0.

        A seeded draw happens on the generator's device (the CPU for ``torch.Generator()``) and is then
        copied, so one seed gives the same adapter on every device (CUDA refuses a CPU generator).
        """
        with torch.no_grad():
            if generator is None:
                nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            else:
                draw = torch.empty(self.lora_A.shape, dtype=self.lora_A.dtype, device=generator.device)
                nn.init.kaiming_uniform_(draw, a=math.sqrt(5), generator=generator)
                self.lora_A.copy_(draw)
            self.lora_B.zero_()


if TYPE_CHECKING:
    class _LoraAdapters(nn.ModuleDict):
        """What :attr:`MultiLoraLinear.adapters` is to the type checker: a ModuleDict of LoraAdapters only."""

        def __getitem__(self, key: str) -> LoraAdapter: ...
        def items(self) -> ItemsView[str, LoraAdapter]: ...


class MultiLoraLinear(nn.Module):
    """Wraps a frozen Linear: ``y = W0 x + sum_k w[k] s_k B_k A_k x`` with context-given weights.

    Args:
        base_layer: the frozen ``nn.Linear`` (kept as ``self.base_layer``, restored on removal).
        context: the model-wide weights holder shared by every adapted layer.
        name: the module path in the model (for error messages and file keys).
    """

    def __init__(self, base_layer: nn.Linear, context: AdapterContext, name: str) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise AdapterError(f"{name} is a {type(base_layer).__name__}, not an nn.Linear")
        self.base_layer = base_layer
        self.context = context
        self.layer_name = name
        self.adapters = cast("_LoraAdapters", nn.ModuleDict())  # every value a LoraAdapter (add_adapter)
        self.merged: str | None = None
        self.token_proj: nn.Parameter | None = None  # a per-token router's projection (r, d): AMoLE's P
        self._original_weight: torch.Tensor | None = None
        # (names, dtype) -> (parameter versions, A stack, B stack), reused while the adapters are unchanged
        self._stack_cache: dict[tuple[tuple[str, ...], torch.dtype],
                                tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}

    @property
    def in_features(self) -> int:
        return int(self.base_layer.in_features)

    @property
    def out_features(self) -> int:
        return int(self.base_layer.out_features)

    # --- storage -------------------------------------------------------------------------------

    def add_adapter(self, name: str, config: LoraConfig, generator: torch.Generator | None = None) -> LoraAdapter:
        """Create adapter ``name`` with PEFT's init (its update is zero until trained or loaded)."""
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} already exists in {self.layer_name}")
        adapter = LoraAdapter(self.in_features, self.out_features, config, device=self.base_layer.weight.device)
        adapter.train(self.training)
        adapter.reset(generator)
        self.adapters[name] = adapter
        self._stack_cache.clear()
        return adapter

    def delete_adapter(self, name: str) -> None:
        """Remove adapter ``name`` (refused while it is merged)."""
        if self.merged == name:
            raise AdapterError(f"adapter {name!r} is merged into {self.layer_name}; unmerge it first")
        del self.adapters[name]
        self._stack_cache.clear()

    def set_weights(self, name: str, A: torch.Tensor, B: torch.Tensor) -> None:
        """Copy ``A`` (r, d) and ``B`` (o, r) into adapter ``name`` after checking shapes and values."""
        adapter = self._get(name)
        expected_a, expected_b = tuple(adapter.lora_A.shape), tuple(adapter.lora_B.shape)
        if tuple(A.shape) != expected_a or tuple(B.shape) != expected_b:
            raise AdapterError(
                f"{self.layer_name}: adapter {name!r} expects lora_A {expected_a} and lora_B "
                f"{expected_b} (rank {adapter.config.r}, layer {self.in_features}->{self.out_features}), "
                f"got {tuple(A.shape)} and {tuple(B.shape)}"
            )
        if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
            raise AdapterError(f"{self.layer_name}: adapter {name!r} weights contain NaN or inf")
        with torch.no_grad():
            adapter.lora_A.copy_(A)
            adapter.lora_B.copy_(B)
        self._stack_cache.clear()

    def _get(self, name: str) -> LoraAdapter:
        if name not in self.adapters:
            raise AdapterError(
                f"{self.layer_name} has no adapter {name!r}; loaded: {sorted(self.adapters.keys())}"
            )
        return self.adapters[name]

    def invalidate_cache(self) -> None:
        """Forget stacked copies (call after changing adapter tensors in place)."""
        self._stack_cache.clear()

    # --- merge ---------------------------------------------------------------------------------

    def merge(self, name: str) -> None:
        """Fold adapter ``name`` into W0 so a single-adapter forward costs nothing extra."""
        if self.merged is not None:
            raise AdapterError(f"{self.layer_name} already has {self.merged!r} merged; unmerge it first")
        adapter = self._get(name)
        weight = self.base_layer.weight
        self._original_weight = weight.detach().clone()
        delta = (adapter.lora_B.detach().float() @ adapter.lora_A.detach().float()) * adapter.scaling
        with torch.no_grad():
            weight.copy_((weight.float() + delta).to(weight.dtype))
        self.merged = name

    def unmerge(self) -> None:
        """Restore the exact original W0 (a saved copy, not a subtraction with rounding error)."""
        if self.merged is None or self._original_weight is None:
            return
        with torch.no_grad():
            self.base_layer.weight.copy_(self._original_weight)
        self._original_weight = None
        self.merged = None

    # --- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        state = self.context.current
        if self.merged is not None:
            self._check_merged(state, x)
            return result
        if state is not None and state.routing is not None:
            result = state.routing.forward(self, x, result)  # a per-token router (AMoLE) adds its update
            # Plain-adapter rows may share the batch (serving); their weights follow below.
        if state is None or not state.names:
            return result
        if state.row is not None:
            return self._uniform(state, state.row, x, result)
        present = [k for k, n in enumerate(state.names) if n in self.adapters]
        if not present:
            return result
        squeeze = x.dim() == 2
        x3 = x.unsqueeze(1) if squeeze else x  # (B, T, d)
        out = result.unsqueeze(1) if squeeze else result  # (B, T, o)
        plan = self._plan(state, tuple(present), x3)
        for k, column in plan.dense:
            A, B, adapter = self._tensors(state, state.names[k], x3.dtype)
            delta = lora_delta(adapter.dropout(x3), A, B, adapter.scaling)
            out = out + (delta * column.to(delta.dtype)).to(out.dtype)
        if plan.gathered:
            out = self._gathered(state, plan, x3, out)
        return out.squeeze(1) if squeeze else out

    def _uniform(self, state: AdapterWeights, row: tuple[float, ...], x: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        """Every row's weights are ``row``: each adapter on is one dense update, its weight a host float."""
        for name, w in zip(state.names, row, strict=True):
            if w == 0.0 or name not in self.adapters:
                continue
            A, B, adapter = self._tensors(state, name, x.dtype)
            delta = lora_delta(adapter.dropout(x), A, B, adapter.scaling)  # (..., o)
            out = out + (delta if w == 1.0 else delta * w).to(out.dtype)
        return out

    def _plan(self, state: AdapterWeights, present: tuple[int, ...], x3: torch.Tensor) -> _Plan:
        """Dense and gathered adapters of this forward, memoised on the context for all layers."""
        scalings = tuple(self.adapters[state.names[k]].scaling for k in present)
        key = (present, scalings, int(x3.shape[0]), int(x3.shape[1]), x3.device)
        plan = state.plans.get(key)
        if plan is not None:
            return cast(_Plan, plan)  # the context's memo holds only what this method stores below
        weights = self._rows_for(state, x3).to(device=x3.device)
        if weights.dim() == 3 and weights.shape[1] != x3.shape[1]:
            raise AdapterError(
                f"per-token adapter weights cover {weights.shape[1]} tokens, the input has {x3.shape[1]}"
            )
        used = slot_usage(weights)  # (B, K)
        counts = used.sum(dim=0).tolist()
        dense = [(k, weight_column(weights, k)) for k in present if counts[k] == x3.shape[0]]
        gathered = [k for k in present if 0 < counts[k] < x3.shape[0]]
        rows = local = coef = None
        if gathered:
            rows, local = used[:, gathered].nonzero(as_tuple=True)  # pairs (row, index into gathered)
            scal = torch.tensor([scalings[present.index(k)] for k in gathered], dtype=weights.dtype, device=x3.device)
            cols = torch.tensor(gathered, device=x3.device)[local]
            w = weights[rows, cols] if weights.dim() == 2 else weights[rows, :, cols]  # (N,) / (N, T)
            coef = (w * scal[local].unsqueeze(-1)).unsqueeze(-1) if w.dim() == 2 else (w * scal[local]).view(-1, 1, 1)
        plan = _Plan(dense, tuple(state.names[k] for k in gathered), rows, local, coef)
        state.plans[key] = plan
        return plan

    def _rows_for(self, state: AdapterWeights, x: torch.Tensor) -> torch.Tensor:
        """Return weights with one row per input row; beam search repeats each row ``n`` times."""
        weights = state.weights
        rows, batch = state.rows(), int(x.shape[0])
        if rows == batch:
            return weights
        if rows > 0 and batch % rows == 0:
            return weights.repeat_interleave(batch // rows, dim=0)
        raise AdapterError(
            f"adapter weights have {rows} rows but the batch has {batch} rows ({self.layer_name})"
        )

    def _tensors(self, state: AdapterWeights, name: str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, LoraAdapter]:
        """Adapter ``name``'s A and B in the activations' dtype (fp32 adapters in a bf16 model)."""
        adapter = self.adapters[name]
        A: torch.Tensor = adapter.lora_A
        B: torch.Tensor = adapter.lora_B
        if state.trainable is not None and name not in state.trainable:
            A, B = A.detach(), B.detach()
        if A.dtype != dtype:  # a differentiable cast: fp32 master weights still get their gradients
            A, B = A.to(dtype), B.to(dtype)
        return A, B, adapter

    def _gathered(self, state: AdapterWeights, plan: _Plan, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        names = plan.gathered
        A_stack, B_stack = self._stacks(state, names, x.dtype)
        assert plan.rows is not None and plan.local is not None and plan.coef is not None
        xg = x.index_select(0, plan.rows)  # (N, T, d)
        if self.training:  # a mask per (row, adapter) pair, each at its adapter's own rate
            xg = lora_dropout_rows(xg, [self.adapters[n].config.dropout for n in names], plan.local)
        y = gathered_lora_delta(xg, A_stack, B_stack, plan.local, plan.coef)  # (N, T, o)
        return out.index_add(0, plan.rows, y.to(out.dtype))

    def _stacks(self, state: AdapterWeights, names: tuple[str, ...],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered adapters' A and B stacked in ``dtype`` (cached outside autograd)."""
        pairs = [self._tensors(state, n, dtype) for n in names]
        if not (torch.is_grad_enabled() and any(a.requires_grad or b.requires_grad for a, b, _ in pairs)):
            return self.frozen_stacks(names, dtype)
        A_stack = stack_padded([a for a, _, _ in pairs], rank_dim=0)  # (S, r_max, d)
        B_stack = stack_padded([b for _, b, _ in pairs], rank_dim=1)  # (S, o, r_max)
        return A_stack, B_stack

    def frozen_stacks(self, names: tuple[str, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapters ``names``' A (S, r_max, d) and B (S, o, r_max), rank-padded, in ``dtype``, detached.

        Cached per (names, dtype) until one of the adapters' weights changes in place (optimizer step,
        ``set_weights``): decode steps would otherwise re-stack the same tensors in every layer.
        """
        adapters = [self._get(n) for n in names]
        versions = tuple(a.lora_A._version + a.lora_B._version for a in adapters)
        hit = self._stack_cache.get((names, dtype))
        if hit is not None and hit[0] == versions:
            return hit[1], hit[2]
        A_stack = stack_padded([a.lora_A.detach().to(dtype) for a in adapters], rank_dim=0)
        B_stack = stack_padded([a.lora_B.detach().to(dtype) for a in adapters], rank_dim=1)
        if len(self._stack_cache) > 64:
            self._stack_cache.clear()
        self._stack_cache[(names, dtype)] = (versions, A_stack, B_stack)
        return A_stack, B_stack

    def _check_merged(self, state: AdapterWeights | None, x: torch.Tensor) -> None:
        if state is None:
            return
        weights = state.weights
        if not state.names:
            raise AdapterError(
                f"{self.layer_name} has {self.merged!r} merged; a base-only forward needs unmerge()"
            )
        ok = self.merged in state.names
        if ok:
            k = state.names.index(self.merged)
            expected = torch.zeros_like(weights)
            expected[..., k] = 1.0
            ok = bool(torch.equal(weights, expected))
        if not ok:
            raise AdapterError(
                f"{self.layer_name} has adapter {self.merged!r} merged into W0; per-row or mixed "
                "adapter weights need unmerge() first"
            )

    def extra_repr(self) -> str:
        return f"{self.layer_name}: adapters={list(self.adapters.keys())}, merged={self.merged}"
