"""One engine step's forwards: chunked, batched prefill passes, the two passes of a routed request, the decode.

Each step prefills at most ``max_prefill_tokens`` prompt tokens in one batched forward (AMoLE rows
alone). A routed request (FedDPA instance-wise weighting, paper 000 section 4.3) first runs a
routing pass with its prefill weights; when the routing pass ends within the step, its exact pass
with the routed weights runs in the same step, so its first token comes one step sooner: a routing
pass that would end here is started only while the budget holds both passes (or the step has
nothing else to do). In a step with no running rows nobody's next token waits on the step, so the
budget bounds each forward instead (its activations): the exact passes of the prompts routed in the
first forward run in a second forward of their own budget. A burst of routed prompts then takes one
step of two forwards rather than a second step that reads the weights twice more for its last
prompts. Whether the step then decodes is the engine's choice (:meth:`Engine.step`, made
before its first pass is planned); when it does, the running rows' decode rides in the first pass's batched
forward on the fused runner (:meth:`serving.engine.executor.Executor.mixed`), so a mixed step reads the
weights once per pass instead of once more for the decode. A row whose prefill ends in a step takes
its next token in the following step.

The scheduler returns each row's outcome (its sampled token and log-probabilities, or the exception
that fails it) in the order the rows went through; the engine records the tokens and ends the
finished and failed sequences (:meth:`serving.engine.Engine.step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.runner.inputs import DecodeRow, PrefillRow
from serving.engine.sampling import RowHistory, TokenLogprob

if TYPE_CHECKING:
    import torch

    from serving.engine.executor import Executor, RowOut
    from serving.engine.lifecycle import Lifecycle
    from serving.engine.sequence import SeqState

RowOutcome = tuple[int, TokenLogprob | None] | Exception  # a row's sampled token and log-probs, or why it failed
RowOutcomes = list[tuple["SeqState", RowOutcome]]


@dataclass
class Pass:
    """One prefill pass of a step: its rows (batched plain rows, AMoLE rows alone) and its token budget."""

    budget: int
    exact_budget: int | None = None  # the exact passes' own budget (a step with no running rows); None: shared
    left: int = field(init=False)  # budget not yet taken
    exact_left: int = field(init=False)  # exact_budget not yet reserved
    plain: list[tuple[SeqState, PrefillRow]] = field(default_factory=list)
    solo: list[tuple[SeqState, PrefillRow]] = field(default_factory=list)  # alone: their last token is the last column

    def __post_init__(self) -> None:
        self.left = self.budget
        self.exact_left = self.exact_budget or 0


class Scheduler:
    """Plans and runs one step's passes over the executor, moving sequences through their phases.

    Args:
        executor: runs the forwards and samples.
        lifecycle: records prompt log-probabilities and ends prefill phases (routing included).
    """

    def __init__(self, executor: Executor, lifecycle: Lifecycle) -> None:
        self.executor, self.lifecycle = executor, lifecycle

    def plan(self, seqs: list[SeqState], budget: int, reserve: bool = False, exact_budget: int | None = None
             ) -> Pass:
        """Choose one chunk of each of ``seqs`` within ``budget`` tokens (nothing runs yet).

        With ``reserve``, a routing pass that would end in this step is taken only while the budget
        also holds its exact pass (the whole prompt again), unless nothing was taken yet: a burst of
        routed prompts then gets its first tokens in arrival order, a step's worth at a time, instead
        of every routing pass first and every first token a step later. With ``exact_budget`` (a
        step with no running rows) the exact passes are held by that budget of their own instead.
        """
        plan = Pass(budget, exact_budget)
        for seq in seqs:
            if plan.left <= 0:
                break
            n = min(len(seq.ids) - seq.filled, plan.left)
            req = seq.handle.request
            both = seq.phase == "route" and req.exact_prefill and seq.filled + n == len(seq.ids)
            room = plan.left - n if exact_budget is None else plan.exact_left  # for the exact pass
            if reserve and both and len(seq.ids) > room and (plan.plain or plan.solo):
                continue
            if both and exact_budget is not None:
                plan.exact_left -= len(seq.ids)
            plan.left -= n
            final = seq.phase == "fill" or not req.exact_prefill  # this pass's KV and logits are kept
            row = PrefillRow(seq.kv_slot, tuple(seq.ids[seq.filled: seq.filled + n]), seq.filled,
                             seq.adapters, want_state=seq.phase == "route",
                             all_logits=final and req.sampling.prompt_logprobs is not None)
            (plan.plain if seq.adapters.plain else plan.solo).append((seq, row))
        return plan

    def run(self, first: Pass, decoding: list[SeqState]) -> tuple[int, RowOutcomes]:
        """Run this step's first pass (``decoding``'s rows in its forward), then the exact passes it unlocks.

        Routed rows whose routing pass ends here start their exact (second) pass in the same step when
        the step's token budget allows: a FedDPA request's first token comes one step sooner.

        Returns:
            The prompt tokens that went through, and the outcome of every row that took a token or
            failed, in the order they went through.
        """
        outcomes: RowOutcomes = []
        rerouted = self._run(first, decoding, outcomes)
        tokens = first.budget - first.left
        budget = first.left if first.exact_budget is None else first.exact_budget
        if rerouted and budget > 0:
            second = self.plan(rerouted, budget)
            self._run(second, [], outcomes)
            tokens += second.budget - second.left
        return tokens, outcomes

    def _run(self, plan: Pass, decoding: list[SeqState], outcomes: RowOutcomes) -> list[SeqState]:
        """Run ``plan``'s forwards, ``decoding``'s decode rows riding in its batched one.

        Returns:
            The sequences this pass moved from ``route`` to ``fill`` (outcomes appended to ``outcomes``).
        """
        rerouted: list[SeqState] = []
        rows = [DecodeRow(s.kv_slot, s.next_token, s.position, s.adapters) for s in decoding]
        groups = ([plan.plain] if plan.plain else []) + [[item] for item in plan.solo]
        for group in groups:
            outs, decoded = self.executor.mixed([row for _, row in group], rows)
            if rows:
                self._decoded(decoding, decoded, outcomes)
                decoding, rows = [], []
            done: list[tuple[SeqState, RowOut]] = []
            for (seq, row), out in zip(group, outs, strict=True):
                if isinstance(out, Exception):
                    outcomes.append((seq, out))
                    continue
                if out.chunk_logits is not None:
                    self.lifecycle.record_prompt_logprobs(seq, row, out.chunk_logits)
                seq.filled = row.end
                routing = seq.phase == "route"
                try:
                    if self.lifecycle.prefilled(seq, out):
                        done.append((seq, out))
                    elif routing and seq.phase == "fill":
                        rerouted.append(seq)
                except Exception as exc:  # noqa: BLE001 - a failing router fails its request only
                    outcomes.append((seq, exc))
            self._first_tokens(done, outcomes)
        if rows:  # nothing to prefill: a decode step
            self._decoded(decoding, self.executor.decode(rows), outcomes)
        return rerouted

    def _first_tokens(self, done: list[tuple[SeqState, RowOut]], outcomes: RowOutcomes) -> None:
        if not done:
            return
        for seq, out in done:
            if seq.amole is not None and out.counts is not None and seq.layer_idx is not None:
                seq.usage = out.counts[seq.layer_idx, : seq.amole.bundle.num_experts].cpu()
        self._sample([s for s, _ in done], [o.logits for _, o in done], outcomes)

    def _decoded(self, seqs: list[SeqState], outs: list[RowOut | Exception], outcomes: RowOutcomes) -> None:
        """Sample the next token of each decoded row in ``seqs`` (a row whose forward failed fails alone)."""
        ok: list[tuple[SeqState, RowOut]] = []
        for seq, out in zip(seqs, outs, strict=True):
            if isinstance(out, Exception):
                outcomes.append((seq, out))
            else:
                ok.append((seq, out))
                if seq.amole is not None and out.counts is not None and seq.usage is not None:
                    seq.usage += out.counts[seq.layer_idx, : seq.amole.bundle.num_experts].cpu()
        self._sample([s for s, _ in ok], [o.logits for _, o in ok], outcomes)

    def _sample(self, seqs: list[SeqState], logits: list[torch.Tensor], outcomes: RowOutcomes) -> None:
        histories = [RowHistory(s.ids, s.output, self.lifecycle.eos_ids, s.matcher) for s in seqs]
        picked = self.executor.sample(logits, [s.handle.request.sampling for s in seqs], [s.generator for s in seqs],
                                      histories)
        outcomes.extend(zip(seqs, picked, strict=True))

