"""Adapter slots on the device: the LoRA weights a decode step needs, stacked once, read in two GEMMs.

The one contract (ARCHITECTURE.md) asks each adapted Linear for ``y = W0 x + sum_k w[b, k] s_k B_k A_k x``.
With the step's adapters placed in ``S`` slots, every projection group of a layer (q/k/v share
their input, so do gate/up) keeps one stack ``A`` of shape ``(S * n_t * r, d_in)`` (slot-major, then
target, then rank) and one ``Bt`` of shape ``(S * n_t * r, d_out)`` whose rows put each target's
``B_k^T`` under that target's output columns (zeros elsewhere). Then, for the whole batch,

    h = (x @ A^T) * wexp        # (N, S n_t r): wexp[b, (s, t, j)] = w[b, s] * scaling_s
    y += h @ Bt                 # one GEMM adds every row's weighted adapters to every target

is exactly the contract (zero weights add exact zeros): no Python loop over adapters or rows, no
gather of per-row weight copies (Punica's BGMV and S-LoRA read each adapter once per step; so does
this), and the stacks have fixed addresses, so a CUDA graph captured over the first ``S_b`` slots
stays valid while adapters move in and out of slots. A slot is filled when a step first needs its
adapter and reused while the adapter (its internal, versioned name and its tensors) is unchanged.

Where the runner holds its own plain compute copy of a group's base matrix ``W`` (``autocast-bf16`` on a
CPU whose torch lacks oneDNN's packed form, which is faster still and stays with the runner: nobody
else reads that copy), the slots take it over and keep ``A`` under it in one
taller matrix ``[W; A]``: one GEMM gives the base output and ``x @ A^T`` together (``y`` and ``h`` are
column blocks of its result, the same products as two GEMMs), which saves a call per adapted group per
layer, about 1-1.7 ms of a 44 ms SmolLM2 decode step of 8 FedDPA rows on a 2-core CPU.

Where the runner's matrices are oneDNN-packed (``packed``: CPU bf16, :mod:`serving.engine.runner.layout`), the
two GEMMs read packed copies of the stacks' first ``R`` rows too, ``R`` the most a step has used since a
slot last changed (a step using fewer pads its weights with zeros, so steps of different widths do not
repack): 2.2-3.4 ms less of a 36-38 ms SmolLM2 decode step of 8 FedDPA rows. A fill or a growth drops
them; the next step repacks, 60 small matrices for SmolLM2.

A group's stacks cover every target adapted in any decoder layer (the union of the served adapters'
targets, :mod:`serving.pool.targets`); an adapter without weights in a layer or a target leaves its rows
there zero, so adapters of different target sets share one step exactly. An adapter with weights outside
these groups (a regex reaching ``lm_head``) does not :meth:`LoraSlots.fits` and runs on the HF runner.

Every slot holds the stacks' rank, a smaller adapter zero-padded, and a step reads the padding too.
Without CUDA graphs the rank therefore follows the adapters: it starts at 0 (no stacks) and grows to
the largest rank a step has needed, up to ``max_lora_rank`` (the stacks are remade and the slots
refilled); a run of rank-8 adapters reads rank-8 stacks, not the ``max_lora_rank`` of 16 (half the
adapter bytes and products of every step). Under CUDA graphs the rank is fixed at ``max_lora_rank``,
as vLLM's, because captured graphs hold the stacks' addresses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapters import AdaptedModel, LoraConfig, MultiLoraLinear
from serving.engine.runner.layout import in_feature_major, linear, lone_row, pack, twice

logger = logging.getLogger(__name__)

# A decoder layer's projection as the runner finds it: the model's Linear, or the adapter layer around it.
Projection = torch.nn.Linear | MultiLoraLinear

# projection groups of a Llama-family decoder layer, each with the targets sharing its input
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class GroupLayout:
    """Where a group's targets sit: the adapted targets, and each one's output column range."""

    targets: tuple[str, ...]  # adapted targets of the group, in GROUPS order
    columns: tuple[tuple[int, int], ...]  # (start, stop) of each target in the group's output
    d_in: int
    d_out: int


class LoraSlots:
    """Per-layer, per-group adapter stacks for ``capacity`` slots of rank :attr:`rank`.

    Args:
        adapted: the injected model whose adapters are copied in.
        layers: per decoder layer, target name -> its module (MultiLoraLinear or plain Linear).
        capacity: slots (adapters usable in one step).
        rank: the largest rank a slot may hold (smaller ranks are zero-padded).
        dtype: the compute dtype of the stacks.
        device: the model's device.
        grow: start at rank 0 and grow to the largest rank placed so far (at most ``rank``); without
            it the stacks have rank ``rank`` from the start and never move (CUDA graphs).
        bases: per decoder layer, the runner's own compute copies (group -> ``(d_out, d_in)`` matrix,
            ``group + "_bias"`` -> bias or None) to fold each adapted group's ``A`` stack under (see the
            module docstring); the runner then computes those groups with :meth:`linear` and may drop
            its copies. None: separate ``A`` stacks.
        packed: :meth:`apply` reads oneDNN-packed copies of the stacks (CPU bf16, where the runner packs).
    """

    def __init__(self, adapted: AdaptedModel, layers: Sequence[dict[str, Projection]], capacity: int, rank: int,
                 dtype: torch.dtype, device: torch.device, grow: bool = False,
                 bases: Sequence[dict[str, torch.Tensor | None]] | None = None, packed: bool = False) -> None:
        self.adapted, self.capacity, self.max_rank, self.packed = adapted, capacity, rank, packed
        self.rank = 0 if grow else rank  # the rank every slot holds now
        self.dtype, self.device = dtype, device
        self.layers = list(layers)
        self.layouts: dict[str, GroupLayout] = {}
        for group, targets in GROUPS.items():
            # a target adapted in any layer has rows in every layer's stacks (zero where a layer lacks it)
            adapted_targets = tuple(t for t in targets
                                    if any(isinstance(mods.get(t), MultiLoraLinear) for mods in self.layers))
            if not adapted_targets:
                continue
            mods, columns, start = self.layers[0], [], 0
            for t in targets:
                width = int(mods[t].out_features)
                if t in adapted_targets:
                    columns.append((start, start + width))
                start += width
            d_in = int(mods[targets[0]].in_features)
            self.layouts[group] = GroupLayout(adapted_targets, tuple(columns), d_in, start)
        # per layer, folded group -> ([W; A] (d_out + S*nt*r, d_in), [b; 0] or None)
        self.folded: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = [{} for _ in self.layers]
        if bases is not None and not in_feature_major(device, dtype):
            for folded, base in zip(self.folded, bases, strict=True):
                for group in self.layouts:
                    w = base[group]
                    assert w is not None and w.dtype == dtype and w.shape == (self.layouts[group].d_out,
                                                                              self.layouts[group].d_in)
                    folded[group] = (w, base.get(group + "_bias"))
        # the module paths these stacks apply: an adapter with weights anywhere else runs on the HF runner
        self.covered = frozenset(mods[t].layer_name for mods in self.layers for lay in self.layouts.values()
                                 for t in lay.targets if isinstance(mods.get(t), MultiLoraLinear))
        self._fit: dict[str, tuple[LoraConfig, bool]] = {}  # adapter -> (its config, whether covered)
        self.stacks = self._allocate(self.rank)
        # per layer, group -> (R, packed A[:R] (R, d_in), packed Bt[:R]^T (d_out, R)); dropped when a slot changes
        self._packed: list[dict[str, tuple[int, torch.Tensor, torch.Tensor]]] = [{} for _ in self.layers]
        self.names: list[str | None] = [None] * capacity  # slot -> internal adapter name
        self.scaling = [0.0] * capacity
        self._fingerprint: list[tuple[int, ...] | None] = [None] * capacity
        self._last_used = [0] * capacity
        self._tick = 0

    def _allocate(self, rank: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Zeroed stacks of ``rank``: per layer, group -> (A (S*nt*r, d_in), Bt (S*nt*r, d_out))."""
        stacks = []
        major = in_feature_major(self.device, self.dtype)
        for folded in self.folded:
            per: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for group, lay in self.layouts.items():
                rows = self.capacity * len(lay.targets) * rank
                if group in folded:  # [W; A]: the base rows kept (from the copy, or the previous [W; A])
                    w, b = folded[group]
                    ext = torch.zeros(lay.d_out + rows, lay.d_in, dtype=self.dtype, device=self.device)
                    ext[: lay.d_out] = w[: lay.d_out]
                    folded[group] = (ext, None if b is None else torch.cat([b[: lay.d_out], b.new_zeros(rows)]))
                    a = ext[lay.d_out:]
                # A in-feature-major where that is the fast GEMM form (CPU float32: serving.engine.runner.layout)
                elif major:
                    a = torch.zeros(lay.d_in, rows, dtype=self.dtype, device=self.device).t()
                else:
                    a = torch.zeros(rows, lay.d_in, dtype=self.dtype, device=self.device)
                per[group] = (a, torch.zeros(rows, lay.d_out, dtype=self.dtype, device=self.device))
            stacks.append(per)
        return stacks

    def _grow(self, rank: int) -> None:
        """Remake the stacks at ``rank`` (every slot empties; :meth:`place` refills what a step needs)."""
        logger.info("adapter slots grow from rank %d to %d (the largest adapter rank served so far)", self.rank, rank)
        self.stacks, self._packed = [], [{} for _ in self.layers]  # freed before the new ones are made
        self.stacks, self.rank = self._allocate(rank), rank
        self.names = [None] * self.capacity
        self._fingerprint = [None] * self.capacity

    # --- placement ------------------------------------------------------------------------------

    @property
    def targets(self) -> frozenset[str]:
        """Every target module name these stacks can serve."""
        return frozenset(t for lay in self.layouts.values() for t in lay.targets)

    def fits(self, names: Sequence[str]) -> bool:
        """True when ``names`` (one step's union) can all be placed: count, rank and targets."""
        if len(set(names)) > self.capacity:
            return False
        for name in names:
            config = self.adapted.configs.get(name)
            if config is None or config.r > self.max_rank or not self._covers(name, config):
                return False
        return True

    def _covers(self, name: str, config: LoraConfig) -> bool:
        """Whether every layer holding adapter ``name`` is one these stacks apply (memoised per config)."""
        held = self._fit.get(name)
        if held is None or held[0] is not config:
            held = (config, self.adapted.targets_of(name) <= self.covered)
            if len(self._fit) > 4 * self.capacity + 64:
                self._fit.clear()
            self._fit[name] = held
        return held[1]

    def place(self, names: Sequence[str]) -> list[int]:
        """Slots holding ``names`` (copying adapters in as needed); call only when :meth:`fits`.

        Slots of adapters no longer in the model are freed first, then the least recently used
        slot not needed by this step is reused. The lowest free slots are used first, so a step's
        slots stay compact (a small graph bucket).
        """
        self._tick += 1
        wanted = list(dict.fromkeys(names))
        need = max((self.adapted.configs[n].r for n in wanted), default=0)
        if need > self.rank:
            self._grow(need)
        for s, held in enumerate(self.names):
            if held is not None and held not in self.adapted.configs:
                self.names[s], self._fingerprint[s] = None, None
        where = {n: s for s, n in enumerate(self.names) if n is not None}
        chosen: dict[str, int] = {}
        for name in wanted:
            slot = where.get(name)
            if slot is not None and self._fingerprint[slot] == self._print(name):
                chosen[name] = slot
        for name in wanted:
            if name in chosen:
                continue
            busy = set(chosen.values())
            free = [s for s in range(self.capacity) if self.names[s] is None and s not in busy]
            slot = free[0] if free else min((s for s in range(self.capacity) if s not in busy),
                                            key=lambda s: self._last_used[s])
            self._fill(slot, name)
            chosen[name] = slot
        for slot in chosen.values():
            self._last_used[slot] = self._tick
        return [chosen[n] for n in names]

    def _print(self, name: str) -> tuple[int, ...]:
        """Identity of an adapter's tensors: module ids and in-place versions of its first layer."""
        for mods in self.layers:  # the first layer holding it (an adapter may skip layers)
            out: list[int] = []
            for t in sorted(self.targets):
                mod = mods.get(t)
                if isinstance(mod, MultiLoraLinear) and name in mod.adapters:
                    a = mod.adapters[name]
                    out += [id(a), a.lora_A._version, a.lora_B._version]
            if out:
                return tuple(out)
        return ()

    def _fill(self, slot: int, name: str) -> None:
        config = self.adapted.configs[name]
        self._packed = [{} for _ in self.layers]
        for mods, per in zip(self.layers, self.stacks, strict=True):
            for group, lay in self.layouts.items():
                A, Bt = per[group]
                nt, r = len(lay.targets), self.rank
                base = slot * nt * r
                A[base: base + nt * r].zero_()
                Bt[base: base + nt * r].zero_()
                for t, target in enumerate(lay.targets):
                    mod = mods[target]
                    if not isinstance(mod, MultiLoraLinear) or name not in mod.adapters:
                        continue
                    adapter = mod.adapters[name]
                    a = adapter.lora_A.detach()  # (r_a, d_in)
                    b = adapter.lora_B.detach()  # (o, r_a)
                    lo, hi = lay.columns[t]
                    row = base + t * r
                    A[row: row + a.shape[0]] = a.to(self.dtype)
                    Bt[row: row + a.shape[0], lo:hi] = b.t().to(self.dtype)
        self.names[slot] = name
        self.scaling[slot] = float(config.scaling)
        self._fingerprint[slot] = self._print(name)

    # --- per step --------------------------------------------------------------------------------

    def weights(self, slots_per_row: Sequence[Sequence[tuple[int, float]]], active: int) -> torch.Tensor:
        """(B, active) weight of each row for each of the first ``active`` slots, times the slot's scaling."""
        rows = [[0.0] * active for _ in slots_per_row]
        for row, pairs in zip(rows, slots_per_row, strict=True):
            for slot, weight in pairs:
                row[slot] += weight * self.scaling[slot]
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), active)

    def expand(self, w: torch.Tensor, group: str) -> torch.Tensor:
        """(B, S_b) slot weights -> (B, S_b * n_t * r) column weights of ``group``'s stacks."""
        lay = self.layouts[group]
        return w.repeat_interleave(len(lay.targets) * self.rank, dim=1)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, wexp: torch.Tensor) -> None:
        """``y += ((x @ A^T) * wexp) @ Bt`` over the first ``wexp.shape[1]`` stack rows (in place).

        Args:
            layer: decoder layer index.
            group: projection group.
            x: (N, d_in) the group's input.
            y: (N, d_out) the group's base output, updated in place.
            wexp: (N, R_b) from :meth:`expand`, in the stacks' dtype.
        """
        rows = wexp.shape[1]
        if self.packed:
            width, a, bt = self._packed_rows(layer, group, rows)
            h = linear(x, a, None) * (wexp if width == rows else F.pad(wexp, (0, width - rows)))  # (N, R)
            y += linear(h, bt, None)
            return
        A, Bt = self.stacks[layer][group]
        if lone_row(x):  # as layout.linear: one float32 row rounds alone unless computed as two
            both = twice(y).addmm_(torch.mm(twice(x), A[:rows].t()) * twice(wexp), Bt[:rows])
            y.copy_(both[:1])
            return
        h = torch.mm(x.to(A.dtype), A[:rows].t()) * wexp  # (N, R_b)
        y.addmm_(h.to(y.dtype), Bt[:rows].to(y.dtype))

    def _packed_rows(self, layer: int, group: str, rows: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(R >= rows, packed A[:R], packed Bt[:R]^T) of a group's stacks, repacked when ``rows`` exceeds R."""
        held = self._packed[layer].get(group)
        if held is None or held[0] < rows:
            A, Bt = self.stacks[layer][group]
            held = (rows, pack(A[:rows], self.dtype), pack(Bt[:rows].t(), self.dtype))
            self._packed[layer][group] = held
        return held

    def linear(self, layer: int, group: str, x: torch.Tensor, wexp: torch.Tensor | None) -> torch.Tensor:
        """A folded group's ``x W^T + b``, plus ``((x @ A^T) * wexp) @ Bt`` with ``wexp``, from one ``[W; A]`` GEMM.

        Args:
            layer: decoder layer index.
            group: a group in ``folded[layer]``.
            x: (N, d_in) the group's input.
            wexp: (N, R_b) from :meth:`expand`, or None for the base output alone.

        Returns:
            (N, d_out); with ``wexp`` a column block of the GEMM's (N, d_out + R_b) result, updated in place.
        """
        ext, bias = self.folded[layer][group]
        d_out = self.layouts[group].d_out
        rows = 0 if wexp is None else wexp.shape[1]
        z = F.linear(x, ext[: d_out + rows], None if bias is None else bias[: d_out + rows])  # (N, d_out + R_b)
        if wexp is None:
            return z
        y, h = z[:, :d_out], z[:, d_out:] * wexp  # h: (N, R_b) weighted x @ A^T, all in the stacks' dtype
        y.addmm_(h, self.stacks[layer][group][1][:rows])
        return y
