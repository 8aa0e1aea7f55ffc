"""The generic runner: any HF causal LM's own forward, reading and writing the engine's KV slots.

It serves every architecture whose attention takes a transformers ``Cache`` and a 4D mask, and every
adapter mode the layers support (per-row weights, AMoLE token routing of paper 002 section 4.2 with
its expert recorder), because the adapted layers read the batch's weights from the model's
:class:`~adapters.context.AdapterContext` exactly as in training. It is eager: the fused Llama runner
(:mod:`serving.engine.runner.llama`) is the fast path; this one is the reference it is tested against.

Sliding-window attention (Mistral, or the sliding layers of Qwen2/Qwen3/Gemma2 configs) is applied by the
mask this runner builds, as transformers' own mask would: a query at position p sees keys p - window + 1 .. p
(the engine's slots still keep every position; the window only hides the older ones).

Prefill chunks are left-padded to one ``(B, T)`` batch, so the last column is every row's last real
token (one ``logits_to_keep=1``). Padding tokens write their K/V into the scratch slot and attend
to their row's first chunk position, so nothing they compute reaches a real sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from adapters import AdaptedModel
from adapters.amole_union import ExpertRecorder
from adapters.context import weight_matrix
from serving.engine.amole import batch_routing
from serving.engine.kv import SlotKV
from serving.engine.runner.inputs import DecodeRow, PrefillRow, RowAdapters, StepOutput


class SlotCache(Cache):
    """A transformers cache view of the engine's slots for one forward.

    Args:
        kv: the engine's slots.
        write_slots: (B * T,) slot each new token's K/V goes to (scratch for padding).
        write_pos: (B * T,) its position in that slot.
        read_slots: (B,) the slot each batch row attends over.
        length: positions read per row (the longest row after this forward).
    """

    def __init__(self, kv: SlotKV, write_slots: torch.Tensor, write_pos: torch.Tensor, read_slots: torch.Tensor,
                 length: int) -> None:
        super().__init__(layers=[])
        self.kv, self.write_slots, self.write_pos = kv, write_slots, write_pos
        self.read_slots, self.length = read_slots, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's K/V (B, H, T, D) in place; return the rows' K/V (B, H, length, D)."""
        k_buf, v_buf = self.kv.k[layer_idx], self.kv.v[layer_idx]
        heads, dim = key_states.shape[1], key_states.shape[3]
        k_new = key_states.transpose(1, 2).reshape(-1, heads, dim)  # (B*T, H, D)
        v_new = value_states.transpose(1, 2).reshape(-1, heads, dim)
        k_buf[self.write_slots, :, self.write_pos] = k_new.to(k_buf.dtype)
        v_buf[self.write_slots, :, self.write_pos] = v_new.to(v_buf.dtype)
        keys = k_buf[:, :, : self.length].index_select(0, self.read_slots)
        values = v_buf[:, :, : self.length].index_select(0, self.read_slots)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class HFRunner:
    """Runs the model's own forward over the engine's slots.

    Args:
        model: the HF causal LM (adapters injected or not).
        adapted: its adapter handle (None: base model only).
        kv: the engine's slots.
        autocast: factory of the compute context (``LoadedModel.autocast``).
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, adapted: AdaptedModel | None, kv: SlotKV,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.model, self.adapted, self.kv, self.autocast = model, adapted, kv, autocast
        self.device = kv.device
        self.sdpa = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
        self.window: int | None = getattr(model.config, "sliding_window", None)
        types = getattr(model.config, "layer_types", None)  # per-layer kinds: one mask per kind, as a dict
        self.layer_types = sorted(set(types)) if types and "sliding_attention" in types else None

    def supports(self, rows: Sequence[RowAdapters]) -> bool:
        """Every row kind runs here."""
        return True

    # --- forward -------------------------------------------------------------------------------

    def _context(self, rows: Sequence[RowAdapters], recorder: ExpertRecorder | None
                 ) -> contextlib.AbstractContextManager[Any]:
        if self.adapted is None:
            if any(r.names or not r.plain for r in rows):
                raise RuntimeError("adapters were requested but the model has none injected")
            return contextlib.nullcontext()
        names, weights = weight_matrix([(r.names, r.weights) if r.plain else ((), ()) for r in rows], self.device)
        routing = batch_routing([r.amole for r in rows], recorder) if any(not r.plain for r in rows) else None
        if routing is not None:
            return self.adapted.context.route_tokens(routing, names, weights if names else None)
        if names:
            return self.adapted.context.use(names, weights)
        return contextlib.nullcontext()

    def _masks(self, query_pos: torch.Tensor, key_limit: torch.Tensor, length: int
               ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The forward's attention mask: :meth:`_mask`, with the sliding window where the config has one (a
        dict by layer kind where only some layers slide)."""
        full = self._mask(query_pos, key_limit, length)
        if self.window is None:
            return full
        windowed = self._mask(query_pos, key_limit, length, self.window)
        if self.layer_types is None:
            return windowed
        return {kind: windowed if kind == "sliding_attention" else full for kind in self.layer_types}

    def _mask(self, query_pos: torch.Tensor, key_limit: torch.Tensor, length: int,
              window: int | None = None) -> torch.Tensor:
        """(B, 1, T, L) mask: key j is visible to query (b, t) when j <= query_pos and j < key_limit[b]
        (and j > query_pos - window with a sliding ``window``)."""
        keys = torch.arange(length, device=self.device)
        allowed = (keys.view(1, 1, -1) <= query_pos.unsqueeze(-1)) & (keys.view(1, 1, -1) < key_limit.view(-1, 1, 1))
        if window is not None:
            allowed &= keys.view(1, 1, -1) > query_pos.unsqueeze(-1) - window
        allowed = allowed.unsqueeze(1)
        if self.sdpa:
            return allowed
        dtype = next(self.model.parameters()).dtype
        dtype = torch.float32 if dtype == torch.float32 else dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed, torch.finfo(dtype).min)

    def _run(self, rows: Sequence[RowAdapters], ids: torch.Tensor, pos: torch.Tensor, write_slots: torch.Tensor,
             write_pos: torch.Tensor, read_slots: torch.Tensor, key_limit: torch.Tensor, length: int,
             want_state: bool, every: Sequence[int] = (), lengths: Sequence[int] = ()) -> StepOutput:
        recorder = ExpertRecorder() if any(not r.plain for r in rows) else None
        cache = SlotCache(self.kv, write_slots, write_pos, read_slots, length)
        mask = self._masks(pos, key_limit, length)
        with self._context(rows, recorder), self.autocast():
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                             use_cache=True, logits_to_keep=0 if any(every) else 1, output_hidden_states=want_state)
        states = out.hidden_states[-1][:, -1].float() if want_state else None  # (B, H)
        # left padding: row b's n_b real positions are the last n_b columns
        all_logits = [out.logits[b, out.logits.shape[1] - n:] if n else None for b, n in enumerate(every)] \
            if any(every) else None
        sums = None
        if want_state:
            hidden, T = out.hidden_states[-1], out.hidden_states[-1].shape[1]
            real = torch.arange(T, device=hidden.device) >= T - torch.tensor(lengths, device=hidden.device)[:, None]
            sums = (hidden.float() * real.unsqueeze(-1)).sum(dim=1)  # (B, H) over each row's chunk tokens
        return StepOutput(logits=out.logits[:, -1], states=states, recorder=recorder, all_logits=all_logits,
                          state_sums=sums)

    def prefill(self, rows: Sequence[PrefillRow]) -> StepOutput:
        """Run every row's chunk (left-padded into one batch); logits and states at each last token."""
        T = max(len(r.tokens) for r in rows)
        self.kv.ensure(max(r.end for r in rows))
        ids, pos, wslot, wpos = [], [], [], []
        for r in rows:
            pad, n = T - len(r.tokens), len(r.tokens)
            ids.append([r.tokens[0]] * pad + list(r.tokens))
            pos.append([r.start] * pad + list(range(r.start, r.start + n)))
            wslot.append([self.kv.scratch] * pad + [r.slot] * n)
            wpos.append([0] * pad + list(range(r.start, r.start + n)))
        dev = self.device
        return self._run(
            [r.adapters for r in rows], torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
            torch.tensor(wslot, device=dev).view(-1), torch.tensor(wpos, device=dev).view(-1),
            torch.tensor([r.slot for r in rows], device=dev), torch.tensor([r.end for r in rows], device=dev),
            max(r.end for r in rows), any(r.want_state for r in rows),
            [len(r.tokens) if r.all_logits else 0 for r in rows], [len(r.tokens) for r in rows])

    def decode(self, rows: Sequence[DecodeRow]) -> StepOutput:
        """One token per row."""
        self.kv.ensure(max(r.position for r in rows) + 1)
        dev = self.device
        slots = torch.tensor([r.slot for r in rows], device=dev)
        pos = torch.tensor([[r.position] for r in rows], device=dev)  # (B, 1)
        return self._run(
            [r.adapters for r in rows], torch.tensor([[r.token] for r in rows], device=dev), pos, slots,
            pos.view(-1), slots, pos.view(-1) + 1, max(r.position for r in rows) + 1, False)
