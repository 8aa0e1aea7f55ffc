"""The fast runner: a fused forward for Llama-family models over the engine's slots.

The HF forward costs a few dozen small kernels and Python calls per layer; decoding is bound by
reading the weights once per step, so those small costs dominate small batches (gpt-fast's lesson).
This forward reads the same parameters (no second copy: q/k/v and gate/up become views of one fused
matrix each, shared with the HF modules) and runs, per layer, one RMSNorm with the residual add,
one q/k/v GEMM, one rotary + KV-write kernel, one attention kernel over each row's own slot and
length, one o GEMM, one RMSNorm, one gate/up GEMM, one SiLU-mul, one down GEMM, and for adapters two
GEMMs per adapted group, or one more where ``A`` is folded under the group's matrix
(:mod:`serving.engine.runner.lora_slots`). A decode step has static shapes and no
host synchronisation, so :mod:`serving.engine.runner.graphs` can capture it as a CUDA graph.

Numerics follow HF's LlamaRMSNorm, rotary embedding and SiLU MLP (same rounding points); the KV
cache holds the compute dtype. Under the ``autocast-bf16`` policy (fp32 weights, bf16 compute: the
CPU default where bf16 is native) the matrices are kept once more in bf16 (half the model's size
again): autocast would otherwise cast every weight on every call, about 40% of a CPU decode step.
Those copies are oneDNN-packed where torch has that form (1.5x faster GEMMs for 1 to 64 rows), else
plain, with the adapter slots holding the adapted groups' copies, each with its ``A`` stack under it.
In float32 on CPU the matrices are stored in-feature-major instead (:mod:`serving.engine.runner.layout`).

Supported: ``llama``, ``mistral`` and ``qwen2`` (q/k/v biases) and ``qwen3`` (per-head q/k RMSNorm,
:mod:`serving.engine.runner.qk_norm`) configs with static RoPE and no sliding window below the context
(``models.families``' table); every other model runs on :mod:`serving.engine.runner.hf`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from adapters import AdaptedModel, MultiLoraLinear
from models.families import FUSED_TYPES
from serving.engine import kernels
from serving.engine.kv import SlotKV
from serving.engine.runner.inputs import DecodeRow, PrefillRow, RowAdapters, StepOutput
from serving.engine.runner.layout import (
    compute_copy,
    forget_compute_copy,
    fuse,
    head_logits,
    in_feature_major,
    linear,
    packed_copy,
    packs,
    reorder,
)
from serving.engine.runner.lora_slots import GROUPS, LoraSlots, Projection
from serving.engine.runner.qk_norm import apply_qk_norm, qk_norm_problem, qk_norms

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

MODEL_TYPES = FUSED_TYPES
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
ROPES = ("default", "linear", "llama3")
TARGETS = tuple(t for group in GROUPS.values() for t in group)


def unsupported_reason(model: nn.Module, max_len: int) -> str | None:
    """Why ``model`` cannot run on the fused runner, or None when it can."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} is not one of {MODEL_TYPES}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "the model does not have the Llama module layout"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(inner.rotary_emb, "rope_type", "default") not in ROPES:
        return f"RoPE type {inner.rotary_emb.rope_type!r} is not static"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < max_len:
        return f"sliding-window attention ({window}) below max_model_len"
    norms = {type(m).__name__ for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)}
    if not norms <= set(NORMS):
        return f"norm layers {sorted(norms)} are not Llama RMSNorm"
    if (problem := qk_norm_problem(layers)) is not None:
        return problem
    if isinstance(model.lm_head, MultiLoraLinear) or isinstance(inner.embed_tokens, MultiLoraLinear):
        return "adapters on the embeddings or the LM head"
    return None


def _base(module: Projection) -> nn.Linear:
    return module.base_layer if isinstance(module, MultiLoraLinear) else module


class LlamaRunner:
    """Fused decode and prefill for a Llama-family model.

    Args:
        model: the HF causal LM (checked with :func:`unsupported_reason` first).
        adapted: its adapter handle (None: base model only).
        kv: the engine's slots.
        autocast: factory of the compute context (``LoadedModel.autocast``).
        lora_capacity: adapter slots (adapters usable by one step).
        lora_rank: largest adapter rank served without falling back to :mod:`serving.engine.runner.hf`.
        grow_rank: the adapter slots start at rank 0 and grow with the adapters served, up to
            ``lora_rank`` (:mod:`serving.engine.runner.lora_slots`); off: fixed at ``lora_rank`` (CUDA graphs).
    """

    name = "fused"

    def __init__(self, model: nn.Module, adapted: AdaptedModel | None, kv: SlotKV,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]], lora_capacity: int = 16,
                 lora_rank: int = 16, grow_rank: bool = False) -> None:
        reason = unsupported_reason(model, kv.max_len)
        if reason is not None:
            raise ValueError(f"the fused runner cannot serve this model: {reason}")
        self.model, self.adapted, self.kv, self.autocast = model, adapted, kv, autocast
        # unsupported_reason checked the Llama module layout (Mistral's and Qwen2's are the same)
        llama = cast("LlamaForCausalLM", model)
        inner, config = llama.model, llama.config
        attn = inner.layers[0].self_attn
        self.head_dim, self.scale = int(attn.head_dim), float(attn.scaling)
        self.hq = int(config.num_attention_heads)
        self.hkv = int(config.num_key_value_heads or self.hq)  # typed int | None; the config fills None in as hq
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, llama.lm_head
        # CPU float32: matrices stored in-feature-major (serving.engine.runner.layout), the fast GEMM form there
        self.in_major = in_feature_major(kv.device, kv.dtype) and self.embed.weight.dtype == kv.dtype
        self.mods: list[dict[str, Projection]] = []
        self.weights: list[dict[str, torch.Tensor | None]] = []
        self.norm_w: list[tuple[torch.Tensor, torch.Tensor, float, float]] = []
        self.qk_norms = [qk_norms(layer.self_attn) for layer in inner.layers]  # Qwen3's; None elsewhere
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            mods = {t: getattr(a if t in GROUPS["qkv"] + GROUPS["o"] else m, t) for t in TARGETS}
            self.mods.append(mods)
            qkv = [_base(mods[t]) for t in GROUPS["qkv"]]
            gate_up = [_base(mods[t]) for t in GROUPS["gate_up"]]
            o, down, major = _base(mods["o_proj"]), _base(mods["down_proj"]), self.in_major
            self.weights.append({
                "qkv": fuse(qkv, "weight", major), "qkv_bias": fuse(qkv, "bias"),
                "o": reorder(o, major), "o_bias": o.bias,
                "gate_up": fuse(gate_up, "weight", major), "gate_up_bias": fuse(gate_up, "bias"),
                "down": reorder(down, major), "down_bias": down.bias})
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            self.norm_w.append((ln1.weight, ln2.weight, float(ln1.variance_epsilon), float(ln2.variance_epsilon)))
        self.splits = [int(_base(self.mods[0][t]).out_features) for t in GROUPS["qkv"]]
        self.head_weight = self.lm_head.weight
        sources = [dict(per) for per in self.weights]  # the model's own matrices
        own = kv.dtype != self.embed.weight.dtype and kv.dtype == torch.bfloat16  # autocast-bf16: cast once
        # the runner's own copies, packed where oneDNN reads that form faster (CPU; serving.engine.runner.layout)
        self.packed = own and packs(kv.device, kv.dtype)
        copy = packed_copy if self.packed else compute_copy
        if own:
            for per in self.weights:
                for key, w in per.items():
                    if w is not None and w.dim() == 2:
                        per[key] = copy(w, kv.dtype)
                    elif w is not None and self.packed:  # a bias, cast once instead of on every call
                        per[key] = w.detach().to(kv.dtype)
            self.head_weight = copy(self.lm_head.weight, kv.dtype)
        residual = self.embed.weight.dtype
        with torch.inference_mode(False), torch.no_grad():
            positions = torch.arange(kv.max_len, device=kv.device).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=residual, device=kv.device), positions)
        self.cos, self.sin = cos[0], sin[0]  # (max_len, D) in the residual stream's dtype
        # the slots take over plain compute copies of the adapted groups (A folded under W: one GEMM, not two);
        # packed ones stay here (the packed GEMM saves more than the fold, and a packed matrix cannot grow)
        self.slots = (LoraSlots(adapted, self.mods, lora_capacity, lora_rank, kv.dtype, kv.device, grow=grow_rank,
                                bases=self.weights if own and not self.packed else None, packed=self.packed)
                      if adapted is not None else None)
        if self.slots is not None:
            for per, source, folded in zip(self.weights, sources, self.slots.folded, strict=True):
                for group in folded:
                    matrix, held = source[group], per.pop(group)
                    assert matrix is not None and held is not None  # a group's matrix: only biases are None
                    forget_compute_copy(matrix, held)
                    per.pop(group + "_bias")

    # --- what runs here -------------------------------------------------------------------------

    def supports(self, rows: Sequence[RowAdapters]) -> bool:
        """True when every row is a plain (per-row weighted) row whose adapters fit the slots."""
        if any(not r.plain for r in rows):
            return False
        names = list(dict.fromkeys(n for r in rows for n in r.names))
        if not names:
            return True
        if self.slots is None or not self.slots.fits(names):
            return False
        return not any(m.merged is not None for m in self.mods[0].values() if isinstance(m, MultiLoraLinear))

    def slot_weights(self, rows: Sequence[RowAdapters], bucket: Callable[[int], int] = lambda n: n
                     ) -> torch.Tensor | None:
        """(B, S_b) per-row slot weights (scaling included) on the host, or None without adapters."""
        names = list(dict.fromkeys(n for r in rows for n in r.names))
        if not names or self.slots is None:
            return None
        where = dict(zip(names, self.slots.place(names), strict=True))
        active = bucket(max(where.values()) + 1)
        return self.slots.weights([[(where[n], w) for n, w in zip(r.names, r.weights, strict=True)] for r in rows],
                                  active)

    def expand(self, w: torch.Tensor | None, repeat: int | Sequence[int] = 1) -> dict[str, torch.Tensor]:
        """Per group (N, R_b) column weights on the device from (B, S_b) slot weights.

        ``repeat``: tokens per row (one count for every row, or B counts); N is their total.
        """
        if w is None or self.slots is None:
            return {}
        w = w.to(self.kv.device, non_blocking=True)
        if not isinstance(repeat, int):
            counts = list(repeat)  # output_size: no device sync for the count
            w = w.repeat_interleave(torch.tensor(counts, device=w.device), dim=0, output_size=sum(counts))
        elif repeat > 1:
            w = w.repeat_interleave(repeat, dim=0)
        return {g: self.slots.expand(w, g).to(self.kv.dtype) for g in self.slots.layouts}

    # --- the forward ----------------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, layer: int, group: str, lora: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.slots is not None and group in self.slots.folded[layer]:
            return self.slots.linear(layer, group, x, lora.get(group))
        w = self.weights[layer]
        weight = w[group]
        assert weight is not None  # a group's matrix: only biases are None
        y = linear(x, weight, w[group + "_bias"])
        if group in lora and self.slots is not None:
            self.slots.apply(layer, group, x, y, lora[group])
        return y

    def forward_tokens(self, ids: torch.Tensor, pos: torch.Tensor, wslot: torch.Tensor, wpos: torch.Tensor,
                       attend: Callable[[int, torch.Tensor], torch.Tensor], lora: dict[str, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer over N tokens; return the last layer's (output, residual), each (N, H).

        Args:
            ids: (N,) token ids.
            pos: (N,) their positions (rotary).
            wslot: (N,) slot each token's K/V is written to; wpos: (N,) position there.
            attend: (layer, rotated q (N, Hq, D)) -> attention output (N, Hq, D).
            lora: per group (N, R_b) column weights; empty without adapters.
        """
        kv = self.kv
        residual = self.embed(ids)  # (N, H)
        x: torch.Tensor | None = None
        cos, sin = self.cos[pos], self.sin[pos]  # (N, D)
        n = ids.shape[0]
        for i in range(len(self.mods)):
            w1, w2, eps1, eps2 = self.norm_w[i]
            h, residual = kernels.rms_norm(residual if x is None else x.to(residual.dtype), w1, eps1,
                                           None if x is None else residual)
            qkv = self._linear(h, i, "qkv", lora)  # (N, q + 2 kv)
            q, k, v = qkv.split(self.splits, dim=-1)
            q, k = apply_qk_norm(q.view(n, self.hq, self.head_dim), k.view(n, self.hkv, self.head_dim),
                                 self.qk_norms[i])
            q = kernels.rotary_kv_write(q.view(n, self.hq, self.head_dim), k.view(n, self.hkv, self.head_dim),
                                        v.view(n, self.hkv, self.head_dim), cos, sin, kv.k[i], kv.v[i], wslot, wpos)
            o = attend(i, q.to(kv.dtype)).reshape(n, self.hq * self.head_dim)
            o = self._linear(o, i, "o", lora)
            h, residual = kernels.rms_norm(o.to(residual.dtype), w2, eps2, residual)
            a = kernels.silu_mul(self._linear(h, i, "gate_up", lora))
            x = self._linear(a, i, "down", lora)
        assert x is not None
        return x, residual

    def head_states(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm of (N, H) positions: the final-layer states HF reports as ``hidden_states[-1]``."""
        return kernels.rms_norm(x.to(residual.dtype), self.norm.weight, float(self.norm.variance_epsilon), residual)[0]

    def head(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and LM head of (B, H) last tokens: (logits (B, V), normed states (B, H))."""
        h = self.head_states(x, residual)
        return head_logits(h, self.head_weight, self.lm_head.bias, self.in_major), h

    def decode_tensors(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                       lora: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token per row, all inputs device tensors (capturable): (B, V) logits."""
        lengths = pos + 1
        x, residual = self.forward_tokens(
            ids, pos, slots, pos,
            lambda i, q: kernels.decode_attention(q, self.kv.k[i], self.kv.v[i], slots, lengths, self.scale), lora)
        return self.head(x, residual)[0]

    def decode(self, rows: Sequence[DecodeRow]) -> StepOutput:
        """One token per row (eager)."""
        dev = self.kv.device
        self.kv.ensure(max(r.position for r in rows) + 1)
        ids = torch.tensor([r.token for r in rows], device=dev)
        pos = torch.tensor([r.position for r in rows], device=dev)
        slots = torch.tensor([r.slot for r in rows], device=dev)
        lora = self.expand(self.slot_weights([r.adapters for r in rows]))
        with self.autocast():
            return StepOutput(logits=self.decode_tensors(ids, pos, slots, lora))

    def prefill(self, rows: Sequence[PrefillRow], decode: Sequence[DecodeRow] = ()) -> StepOutput:
        """Every row's chunk packed into one (N,) token batch; logits and states at each last token.

        The projections run over the N real tokens only (rows of different lengths, e.g. a routing
        pass after a reused prefix beside a full exact pass, pad nothing there); the attention reads
        them as a right-padded (B, T) batch. ``decode`` rows ride in the same forward (one token each
        after the chunks, attending over their own slots as in :meth:`decode`): a step that prefills and
        decodes reads the weights once, not twice (vLLM's mixed batches). Their logits follow the B
        rows' in ``logits`` (B + D, V); states, chunk logits and state sums cover the B rows only.
        """
        dev, kv = self.kv.device, self.kv
        lens = [len(r.tokens) for r in rows]
        B, T, N, D = len(rows), max(lens), sum(lens), len(decode)
        kv.ensure(max([r.end for r in rows] + [d.position + 1 for d in decode]))
        padded: list[int]
        ids, pos, wslot, padded = [], [], [], []
        for b, r in enumerate(rows):
            ids += list(r.tokens)
            pos += list(range(r.start, r.end))
            wslot += [r.slot] * len(r.tokens)
            padded += range(b * T, b * T + len(r.tokens))
        ids += [d.token for d in decode]
        pos += [d.position for d in decode]
        wslot += [d.slot for d in decode]
        slots = torch.tensor([r.slot for r in rows], device=dev)
        starts = torch.tensor([r.start for r in rows], device=dev)
        lengths = torch.tensor([r.end for r in rows], device=dev)
        lora = self.expand(self.slot_weights([r.adapters for r in rows] + [d.adapters for d in decode]),
                           repeat=lens + [1] * D)
        where = None if N == B * T else torch.tensor(padded, device=dev)  # (N,) each token's (B, T) cell
        dslots = torch.tensor([d.slot for d in decode], device=dev)
        dlengths = torch.tensor([d.position + 1 for d in decode], device=dev)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:  # q: (N + D, Hq, D)
            q, qd = q[:N], q[N:]
            if where is not None:
                q = q.new_zeros(B * T, self.hq, self.head_dim).index_copy_(0, where, q)
            out = kernels.prefill_attention(q.view(B, T, self.hq, self.head_dim), kv.k[i], kv.v[i], slots, starts,
                                            lengths, self.scale).reshape(B * T, self.hq, self.head_dim)
            out = out if where is None else out.index_select(0, where)
            if not D:
                return out
            return torch.cat([out, kernels.decode_attention(qd, kv.k[i], kv.v[i], dslots, dlengths, self.scale)])

        ends = torch.tensor(lens, device=dev).cumsum(0)  # (B,) one past each row's last token
        last = torch.cat([ends - 1, torch.arange(N, N + D, device=dev)])  # (B + D,) the tokens with logits
        position = torch.tensor(pos, device=dev)
        every: list[torch.Tensor | None] | None = None
        with self.autocast():
            x, residual = self.forward_tokens(torch.tensor(ids, device=dev), position,
                                              torch.tensor(wslot, device=dev), position, attend, lora)
            logits, states = self.head(x.index_select(0, last), residual.index_select(0, last))
            x, residual, states = x[:N], residual[:N], states[:B]
            if any(r.all_logits for r in rows):
                every = []
                first = 0  # host offsets: no device sync per row
                for r in rows:
                    real = torch.arange(first, first + len(r.tokens), device=dev)
                    first += len(r.tokens)
                    every.append(self.head(x.index_select(0, real), residual.index_select(0, real))[0]
                                 if r.all_logits else None)
            want = any(r.want_state for r in rows)
            sums = None
            if want:  # final norm over every token, summed per row
                normed = self.head_states(x, residual).float()  # (N, H)
                row_of = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(lens, device=dev),
                                                 output_size=N)
                sums = normed.new_zeros(B, normed.shape[1]).index_add_(0, row_of, normed)  # (B, H)
        return StepOutput(logits=logits, states=states.float() if want else None, all_logits=every, state_sums=sums)
