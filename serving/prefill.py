"""Prefill passes of one engine step: chunked, batched, and the two passes of a routed request.

Each step prefills at most ``max_prefill_tokens`` prompt tokens in one batched forward (AMoLE rows
alone). A routed request (FedDPA instance-wise weighting, paper 000 section 4.3) first runs a
routing pass with its prefill weights; when the routing pass ends within the step, its exact pass
with the routed weights runs in the same step, so its first token comes one step sooner: a routing
pass that would end here is started only while the budget holds both passes (or the step has
nothing else to do). Whether the step then decodes is the engine's choice (:meth:`Engine.step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.lifecycle import Lifecycle
from serving.runner.inputs import PrefillRow

if TYPE_CHECKING:
    import torch

    from serving.executor import Executor, RowOut
    from serving.sequence import Finished, Sequence


class PrefillSteps(Lifecycle):
    """The prefill half of a step (mixed into :class:`serving.engine.Engine`, which owns the state)."""

    executor: Executor
    _active: list[Sequence]

    def _fail(self, seq: Sequence, exc: Exception, finished: Finished) -> None: ...

    def _sampled(self, seqs: list[Sequence], logits: list[torch.Tensor], finished: Finished) -> None: ...

    def _prefill(self, finished: Finished) -> int:
        """Prefill this step's chunks; returns the prompt tokens that went through."""
        # Routed rows whose routing pass ends here start their exact (second) pass in the same step
        # when the step's token budget allows: a FedDPA request's first token comes one step sooner.
        budget = self.config.max_prefill_tokens
        budget, rerouted = self._prefill_pass([s for s in self._active if s.phase in ("route", "fill")], budget,
                                              finished, reserve=True)
        if rerouted and budget > 0:
            budget, _ = self._prefill_pass(rerouted, budget, finished)
        return self.config.max_prefill_tokens - budget

    def _prefill_pass(self, seqs: list[Sequence], budget: int, finished: Finished,
                      reserve: bool = False) -> tuple[int, list[Sequence]]:
        """Prefill one chunk of each of ``seqs`` within ``budget`` tokens.

        With ``reserve``, a routing pass that would end in this step is taken only while the budget
        also holds its exact pass (the whole prompt again), unless nothing was taken yet: a burst of
        routed prompts then gets its first tokens in arrival order, a step's worth at a time, instead
        of every routing pass first and every first token a step later.

        Returns:
            The budget left and the sequences this pass moved from ``route`` to ``fill``.
        """
        plain: list[tuple[Sequence, PrefillRow]] = []
        solo: list[tuple[Sequence, PrefillRow]] = []  # AMoLE rows: alone, so their last token is the last column
        for seq in seqs:
            if budget <= 0:
                break
            n = min(len(seq.ids) - seq.filled, budget)
            req = seq.handle.request
            both = seq.phase == "route" and req.exact_prefill and seq.filled + n == len(seq.ids)
            if reserve and both and n + len(seq.ids) > budget and (plain or solo):
                continue
            budget -= n
            final = seq.phase == "fill" or not req.exact_prefill  # this pass's KV and logits are kept
            row = PrefillRow(seq.slot, tuple(seq.ids[seq.filled: seq.filled + n]), seq.filled,  # type: ignore[arg-type]
                             seq.adapters, want_state=seq.phase == "route",
                             all_logits=final and req.sampling.prompt_logprobs is not None)
            (plain if seq.adapters.plain else solo).append((seq, row))
        rerouted: list[Sequence] = []
        groups = ([plain] if plain else []) + [[item] for item in solo]
        for group in groups:
            outs = self.executor.prefill([row for _, row in group])
            done: list[tuple[Sequence, RowOut]] = []
            for (seq, row), out in zip(group, outs, strict=True):
                if isinstance(out, Exception):
                    self._fail(seq, out, finished)
                    continue
                if out.chunk_logits is not None:
                    self.record_prompt_logprobs(seq, row, out.chunk_logits)
                seq.filled = row.end
                routing = seq.phase == "route"
                try:
                    if self.prefilled(seq, out):
                        done.append((seq, out))
                    elif routing and seq.phase == "fill":
                        rerouted.append(seq)
                except Exception as exc:  # noqa: BLE001 - a failing router fails its request only
                    self._fail(seq, exc, finished)
            self._first_tokens(done, finished)
        return budget, rerouted

    def _first_tokens(self, done: list[tuple[Sequence, RowOut]], finished: Finished) -> None:
        if not done:
            return
        for seq, out in done:
            if seq.amole is not None and out.counts is not None and seq.layer_idx is not None:
                seq.usage = out.counts[seq.layer_idx, : seq.amole.bundle.num_experts].cpu()
        self._sampled([s for s, _ in done], [o.logits for _, o in done], finished)

