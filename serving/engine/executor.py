"""Runs the engine's forwards on the right runner and keeps a failure to the rows that caused it.

Each prefill chunk batch or decode step goes to the fused Llama runner when every row can run there
(plain per-row adapter weights that fit its adapter slots), as a captured CUDA graph on CUDA, and to
the model's own HF forward otherwise (AMoLE token routing, other architectures, too many adapters).
A step that prefills and decodes runs both in one fused forward where it can (:meth:`Executor.mixed`).
If a batched forward or the batched sampling raises, each row is run alone, so only the rows that
fail alone get an error (one request never stops the others). Errors that leave the device
unusable (a CUDA fault) are not contained: they propagate and stop the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from adapters import AdaptedModel
from serving.engine.grammar import apply_masks
from serving.engine.kv import SlotKV
from serving.engine.runner.graphs import DecodeGraphs
from serving.engine.runner.hf import HFRunner
from serving.engine.runner.inputs import DecodeRow, PrefillRow, RowAdapters, StepOutput
from serving.engine.runner.llama import LlamaRunner, unsupported_reason
from serving.engine.sampling import RowHistory, SamplingParams, TokenLogprob, process, sample_batch, token_logprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowOut:
    """One row's share of a forward: logits (V,), state (H,), AMoLE counts (L, E), chunk logits (n, V), and
    the sum (H,) of the final-layer states over the chunk's tokens (a mean-pooled FedDPA route adds them up)."""

    logits: torch.Tensor
    state: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    chunk_logits: torch.Tensor | None = None
    state_sum: torch.Tensor | None = None


def chunk_outs(out: StepOutput, n: int, counts: torch.Tensor | None = None) -> list[RowOut]:
    """The first ``n`` rows of a prefill forward's output, each with its AMoLE ``counts`` (n, L, E) row."""
    return [RowOut(out.logits[b], out.states[b] if out.states is not None else None,
                   counts[b] if counts is not None else None,
                   out.all_logits[b] if out.all_logits is not None else None,
                   out.state_sums[b] if out.state_sums is not None else None) for b in range(n)]


def stacked(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``rows`` (each (V,)) as one contiguous (N, V) tensor, read in one pass when they are evenly spaced
    rows of one tensor.

    A step's rows are the rows of its forward's (B, V) logits, which the CPU head leaves transposed in
    memory (``layout.head_logits``); stacking 64 strided rows one by one took 14 ms of a 280 ms step on
    two cores, one transposing copy of the whole view takes half that (none when already contiguous).
    """
    first = rows[0]
    if len(rows) > 1 and first.dim() == 1:
        ptr, size = first.untyped_storage().data_ptr(), first.element_size()
        step = (rows[1].data_ptr() - first.data_ptr()) // size
        if step > 0 and all(
                r.shape == first.shape and r.stride() == first.stride() and r.dtype == first.dtype
                and r.device == first.device and r.untyped_storage().data_ptr() == ptr
                and r.data_ptr() == first.data_ptr() + i * step * size for i, r in enumerate(rows)):
            return first.as_strided((len(rows), first.shape[0]), (step, first.stride(0))).contiguous()
    return torch.stack(list(rows))


def is_fatal(exc: BaseException) -> bool:
    """True for errors after which the device cannot be trusted (CUDA faults): stop, do not isolate."""
    accelerator = getattr(torch, "AcceleratorError", None)
    return (accelerator is not None and isinstance(accelerator, type) and isinstance(exc, accelerator)) or \
        "CUDA error" in str(exc)


class Executor:
    """The engine's runners over one KV cache.

    Args:
        model: the HF causal LM.
        adapted: its adapter handle (None: base model only).
        kv: the engine's slots.
        autocast: factory of the compute context.
        runner: ``auto`` (fused when the model allows), ``fused`` (required) or ``hf``.
        lora_slots: adapter slots of the fused runner.
        max_lora_rank: largest adapter rank the fused runner serves (its slots grow to it with the
            adapters served, or hold it from the start under CUDA graphs).
        cuda_graphs: capture decode steps on CUDA (Triton kernels when triton imports, else the references).
        max_batch: the engine's largest batch.
    """

    def __init__(self, model: torch.nn.Module, adapted: AdaptedModel | None, kv: SlotKV,
                 autocast: Callable[[], Any], runner: str = "auto", lora_slots: int = 9, max_lora_rank: int = 16,
                 cuda_graphs: bool = True, max_batch: int = 8) -> None:
        self.adapted = adapted
        self.paths = tuple(adapted.layers) if adapted is not None else ()
        self.hf = HFRunner(model, adapted, kv, autocast)
        self.fast: LlamaRunner | None = None
        self.graphs: DecodeGraphs | None = None
        reason = "disabled" if runner == "hf" else unsupported_reason(model, kv.max_len)
        graphs = cuda_graphs and kv.device.type == "cuda" and torch.cuda.is_available()
        if reason is None:  # captured graphs hold the slots' addresses: their rank is fixed then
            self.fast = LlamaRunner(model, adapted, kv, autocast, lora_slots, max_lora_rank, grow_rank=not graphs)
        elif runner == "fused":
            raise ValueError(f"runner 'fused' cannot serve this model: {reason}")
        else:
            logger.info("serving with the HF forward (%s)", reason)
        if self.fast is not None and graphs:
            self.graphs = DecodeGraphs(self.fast, max_batch)

    def runner_name(self, adapters: Sequence[RowAdapters]) -> str:
        """Which runner a batch of rows would use."""
        return "fused" if self.fast is not None and self.fast.supports(adapters) else "hf"

    # --- forwards --------------------------------------------------------------------------------

    def _counts(self, out: StepOutput, adapters: Sequence[RowAdapters], last_token: bool) -> torch.Tensor | None:
        """(B, L, E_max) top-k selections of the AMoLE rows' counted positions, or None without AMoLE rows."""
        widths = [a.amole.bundle.num_experts for a in adapters if a.amole is not None]
        if out.recorder is None or not widths:
            return None
        return out.recorder.counts(self.paths, max(widths), len(adapters), last_token=last_token)

    def _prefill(self, rows: Sequence[PrefillRow]) -> list[RowOut]:
        fast = self.fast if self.fast is not None and self.fast.supports([r.adapters for r in rows]) else None
        out = fast.prefill(rows) if fast is not None else self.hf.prefill(rows)
        return chunk_outs(out, len(rows), self._counts(out, [r.adapters for r in rows], last_token=True))

    def _decode(self, rows: Sequence[DecodeRow]) -> list[RowOut]:
        adapters = [r.adapters for r in rows]
        out: StepOutput | None = None
        if self.fast is not None and self.fast.supports(adapters):
            out = self.graphs.decode(rows) if self.graphs is not None else None
            out = out if out is not None else self.fast.decode(rows)
        else:
            out = self.hf.decode(rows)
        counts = self._counts(out, adapters, last_token=False)
        return [RowOut(out.logits[b], None, counts[b] if counts is not None else None) for b in range(len(rows))]

    def _isolated(self, fn: Callable[[Sequence[Any]], list[RowOut]], rows: Sequence[Any]) -> list[RowOut | Exception]:
        try:
            return list(fn(rows))
        except Exception as exc:  # noqa: BLE001 - contained per row below
            if is_fatal(exc):
                raise
            if len(rows) == 1:
                return [exc]
            logger.warning("a batch of %d rows failed (%s: %s); running each alone", len(rows), type(exc).__name__, exc)
        outs: list[RowOut | Exception] = []
        for row in rows:
            try:
                outs.extend(fn([row]))
            except Exception as exc:  # noqa: BLE001
                if is_fatal(exc):
                    raise
                outs.append(exc)
        return outs

    def prefill(self, rows: Sequence[PrefillRow]) -> list[RowOut | Exception]:
        """Prefill every row's chunk (one forward); per row its output or the exception it raised alone."""
        return self._isolated(self._prefill, rows)

    def decode(self, rows: Sequence[DecodeRow]) -> list[RowOut | Exception]:
        """One decode step over ``rows``; per row its output or the exception it raised alone."""
        return self._isolated(self._decode, rows)

    def fuses(self, prefill: Sequence[PrefillRow], decode: Sequence[DecodeRow]) -> bool:
        """True when :meth:`mixed` runs ``prefill`` and ``decode`` as one forward.

        Only on the fused runner without CUDA graphs (a captured decode step beats an eager mixed
        forward there), and only when the adapters of both halves fit its slots together.
        """
        return bool(prefill and decode and self.fast is not None and self.graphs is None
                    and self.fast.supports([r.adapters for r in prefill] + [r.adapters for r in decode]))

    def mixed(self, prefill: Sequence[PrefillRow], decode: Sequence[DecodeRow]
              ) -> tuple[list[RowOut | Exception], list[RowOut | Exception]]:
        """Prefill ``prefill``'s chunks and decode ``decode``'s rows; per row its output or its exception.

        One forward when :meth:`fuses` says so (the step reads the weights once); if that forward
        raises, or it cannot be fused, the two halves run as :meth:`prefill` and :meth:`decode`, each
        keeping a failure to the rows that cause it alone.
        """
        if self.fuses(prefill, decode):
            assert self.fast is not None  # fuses only on the fused runner
            try:
                out = self.fast.prefill(prefill, decode)
            except Exception as exc:  # noqa: BLE001 - the halves run apart below, each row isolated
                if is_fatal(exc):
                    raise
                logger.warning("a mixed forward of %d + %d rows failed (%s: %s); running its halves apart",
                               len(prefill), len(decode), type(exc).__name__, exc)
            else:
                B = len(prefill)
                firsts: list[RowOut | Exception] = [*chunk_outs(out, B)]
                return firsts, [RowOut(out.logits[B + d]) for d in range(len(decode))]
        return (self.prefill(prefill) if prefill else []), (self.decode(decode) if decode else [])

    @staticmethod
    def sample(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None], histories: Sequence[RowHistory]
               ) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """Next token of each row and its log-probabilities when asked for; a row whose sampling
        fails alone gets its exception."""
        if not logits:
            return []
        try:
            return _sample(stacked(logits), params, generators, histories)
        except Exception as exc:  # noqa: BLE001
            if is_fatal(exc):
                raise
        outs: list[tuple[int, TokenLogprob | None] | Exception] = []
        for row, p, g, h in zip(logits, params, generators, histories, strict=True):
            try:
                outs.extend(_sample(row.unsqueeze(0), [p], [g], [h]))
            except Exception as exc:  # noqa: BLE001
                if is_fatal(exc):
                    raise
                outs.append(exc)
        return outs


def _sample(raw: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
            histories: Sequence[RowHistory]) -> list[tuple[int, TokenLogprob | None] | Exception]:
    """Processors, grammar masks, sampling, and the raw distribution's log-probabilities of the chosen tokens."""
    processed = apply_masks(process(raw, params, histories), [h.matcher for h in histories])
    tokens = sample_batch(processed, params, generators)
    asked = [b for b, p in enumerate(params) if p.logprobs is not None]
    found = dict(zip(asked, token_logprobs(raw[asked], [tokens[b] for b in asked],
                                           [params[b].logprobs or 0 for b in asked]), strict=True)) if asked else {}
    return [(t, found.get(b)) for b, t in enumerate(tokens)]
