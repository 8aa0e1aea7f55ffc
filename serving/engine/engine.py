"""The continuous-batching engine: one frozen base model, per-row adapter weights, streaming, cancel.

Requests wait in a queue and take a KV slot (:mod:`serving.engine.kv`) when one is free. Each step then
prefills waiting prompts in chunks — one batched forward over every admitted request's next chunk,
at most ``max_prefill_tokens`` tokens, so a long prompt never stalls running requests for more than
a chunk (:mod:`serving.engine.scheduler`) — and decodes one token of every running request in that same
forward (one read of the weights per step; apart on CUDA, whose decode steps are captured graphs), each
row with its own adapter weights (the one contract, ARCHITECTURE.md), so one batch mixes clients.
While prompts wait for their first token (queued, or starting their prefill in this step), up to
``max_decode_skips`` steps in a row prefill without decoding, so new requests are answered before the
running rows take their next token (vLLM's prefill-first order, bounded so decoding never starves; a
long prompt's later chunks ride beside the decode). Forwards
run on the fused Llama runner (CUDA graphs on CUDA) or the model's own HF forward (:mod:`serving.engine.executor`).

Routing hook (FedDPA, paper 000 section 4.3): a request with ``weight_fn`` is prefilled with its
``prefill_weights`` (the global adapter alone); the final-layer state of its last prompt token goes to
``weight_fn``, whose weights serve the decode. With ``exact_prefill`` the prompt is prefilled again
with the routed weights, so its KV cache and first token use them too.

AMoLE (paper 002 section 4.2): a request carrying an AMoLE client's ``route`` is routed per token
inside the layers over that client's experts (the layers' token-routing hook), on the HF forward,
and its response reports the experts its generated tokens went to (``route_info["expert_usage"]``).

Failures: an exception while prefilling, routing, sampling or decoding fails only the
requests involved (400 when the request caused it, 500 with the request id otherwise); a request past
``request_timeout_s`` is answered with 504. If the engine thread itself dies (a bug, a CUDA fault),
every waiting and running request is answered at once, :meth:`Engine.health` reports the reason,
:meth:`Engine.submit` refuses with it, and the ``on_failure`` callbacks run (the HTTP server exits
non-zero there so its supervisor restarts it); :meth:`Engine.restart` recovers in-process.

Drive it with :meth:`Engine.step` (explicit loop, tests, batch runs) or :meth:`Engine.start` (a
background thread calling ``step``)::

    engine = Engine(loaded, adapted)
    handle = engine.submit(GenerationRequest(prompt="Hi", sampling=SamplingParams(temperature=0)))
    engine.generate([...])          # or: engine.start(); handle.result(); engine.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from adapters import AdaptedModel
from models import LoadedModel
from serving.engine.config import EngineConfig
from serving.engine.executor import Executor
from serving.engine.host_work import StepClock
from serving.engine.kv import SlotKV
from serving.engine.lifecycle import Lifecycle
from serving.engine.model_lock import ModelLock
from serving.engine.prefix_cache import PrefixCache
from serving.engine.request import GenerationRequest, GenerationResult, RequestHandle
from serving.engine.route_states import RouteStates
from serving.engine.scheduler import RowOutcome, Scheduler
from serving.engine.sequence import Finished, SeqState, error_status, failed, result
from serving.engine.sizing import sized_config
from serving.errors import EngineNotReady, EngineOverloaded, InvalidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Engine", "EngineConfig", "EngineStats", "StepReport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """One engine step that ran a forward: its wall time, prompt tokens prefilled, rows decoded, the engine
    thread's CPU time, and with ``count_syncs`` its host-device synchronisations and the seconds spent in
    them (:mod:`serving.engine.host_work`; on CUDA, ``seconds - sync_seconds`` is the host's own work)."""

    seconds: float
    prefill_tokens: int
    decode_rows: int
    cpu_seconds: float = 0.0
    syncs: int = 0
    sync_seconds: float = 0.0

    @property
    def kind(self) -> str:
        """``prefill``, ``decode`` or ``mixed``."""
        return "mixed" if self.prefill_tokens and self.decode_rows else "prefill" if self.prefill_tokens else "decode"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: waiting and running requests, longest sequence held in the cache."""

    waiting: int
    running: int
    kv_length: int


class Engine:
    """Continuous batching over one frozen model with named adapters.

    The engine owns the queue, the KV slots and the step loop; a :class:`~serving.engine.lifecycle.Lifecycle`
    validates requests and moves them through their phases, and a :class:`~serving.engine.scheduler.Scheduler`
    runs each step's forwards and returns every row's outcome, which the engine records here.

    Args:
        loaded: the base model, tokenizer and compute-dtype policy.
        adapted: the injected adapter handle (None: base model only).
        config: batch, length, time and runner settings.
        model_lock: lock held for every forward; the adapter pool holds the same lock while it
            changes the model's adapters, so a forward never sees a half-loaded adapter.
    """

    def __init__(self, loaded: LoadedModel, adapted: AdaptedModel | None = None, config: EngineConfig = EngineConfig(),
                 model_lock: ModelLock | None = None) -> None:
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.adapted, self.config = adapted, config
        self.model_lock = model_lock if model_lock is not None else ModelLock()
        param = next(self.model.parameters())
        self.device = param.device
        dtype = torch.bfloat16 if loaded.dtype == "autocast-bf16" else param.dtype
        hf = cast("PreTrainedModel", self.model)  # an HF causal LM (models.loading); typed nn.Module in LoadedModel
        mc = hf.config
        config, self.slot_plan = sized_config(config, mc, dtype, self.device)  # auto slots / context
        if self.slot_plan is not None:
            logger.info("%s", self.slot_plan.describe())
        self.config = config
        heads = int(mc.num_attention_heads)
        head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // heads)
        kv_heads = int(getattr(mc, "num_key_value_heads", None) or heads)
        self.kv = SlotKV(int(mc.num_hidden_layers), config.max_batch_size, kv_heads, head_dim, config.max_model_len,
                         dtype, self.device, spare=config.prefix_cache_slots)
        self.prefixes = PrefixCache(self.kv, self._fingerprint)
        self.route_states = RouteStates(config.route_state_cache)
        self.executor = Executor(self.model, adapted, self.kv, loaded.autocast, config.runner,
                                 config.lora_slots or config.max_batch_size + 1, config.max_lora_rank,
                                 config.cuda_graphs, config.max_batch_size)
        self.vocab_size = int(cast(torch.nn.Embedding, hf.get_input_embeddings()).num_embeddings)  # HF: an Embedding
        eos: set[int] = set()
        for value in (getattr(self.tokenizer, "eos_token_id", None),
                      getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)):
            eos.update([value] if isinstance(value, int) else (value or []))
        self.eos_ids = frozenset(eos)
        self.lifecycle = Lifecycle(config, self.tokenizer, adapted, self.vocab_size, self.eos_ids, self.device,
                                   self.prefixes, self.route_states)
        self.scheduler = Scheduler(self.executor, self.lifecycle)
        self._waiting: deque[SeqState] = deque()
        self._active: list[SeqState] = []
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._skipped = 0  # steps in a row that prefilled without decoding
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self.step_observers: list[Callable[[StepReport], None]] = []  # called after each step that ran a forward

    # --- submission (validation and phases in serving.engine.lifecycle) ------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; it joins the batch at the next step.

        Raises:
            InvalidRequest: the prompt is empty, not valid text, holds unknown token ids, or is too long.
            AdapterNotFound: an adapter name is not loaded in the model.
            EngineOverloaded: the waiting queue is full.
            EngineNotReady: the engine is stopping, stopped or failed.
        """
        if self.failure is not None:
            raise EngineNotReady(f"the engine failed ({self.failure}); the server is restarting")
        if self._stopping:
            raise EngineNotReady("the engine is shutting down")
        seq = self.lifecycle.prepare(request)
        with self._cond:
            if len(self._waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests are already waiting; retry later")
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq.handle

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion (stepping here unless the background thread runs)."""
        handles = [self.submit(r) for r in requests]
        if not self.running:
            while not all(h.done for h in handles):
                self.step()
        return [h.result() for h in handles]

    def stats(self) -> EngineStats:
        """Current queue and batch sizes."""
        held = max((s.held for s in self._active), default=0)
        return EngineStats(waiting=len(self._waiting), running=len(self._active), kv_length=held)

    def has_work(self) -> bool:
        """True while requests wait or run."""
        return bool(self._waiting or self._active)

    def health(self) -> str | None:
        """None while the engine can serve; otherwise why not."""
        if self.failure is not None:
            return f"the engine failed: {self.failure}"
        if self._stopping:
            return "the engine is shutting down"
        return None

    # --- background thread -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the background thread drives the engine."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the background thread that calls :meth:`step` whenever there is work."""
        if self.running:
            return
        if self.failure is not None:
            raise EngineNotReady(f"the engine failed ({self.failure}); call restart()")
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fedmosaic-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout`` s, cancel the rest, stop."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            if self.running:
                self._cond.wait_for(lambda: not self.has_work() or not self.running,
                                    max(deadline - time.monotonic(), 0.0))
        for seq in list(self._waiting) + list(self._active):
            seq.handle.cancel()
        thread, self._thread = self._thread, None
        with self._cond:
            self._cond.notify_all()
        if thread is not None:
            thread.join(max(deadline - time.monotonic(), 1.0))
        while self.has_work() and self.failure is None:
            self.step()

    def restart(self) -> None:
        """Recover from a failure: forget it, reset the cache's slots, start the thread again."""
        with self._step_lock:
            self.failure = None
            self.kv.reset()
            self.prefixes.clear()
            self.route_states.clear()
            self._stopping = False
        self.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.has_work() or (self._stopping and self._thread is None))
                if not self.has_work():
                    return
            try:
                self.step()
            except BaseException as exc:  # noqa: BLE001 - a bug or a device fault: answer everyone, report
                self._die(exc)
                return
            with self._cond:
                self._cond.notify_all()  # stop() waits for the queue to drain

    def _die(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        logger.critical("the engine thread failed: %s", reason, exc_info=exc)
        self.failure = reason
        with self._cond:
            seqs = list(self._waiting) + list(self._active)
            self._waiting.clear()
            self._active = []
            self._cond.notify_all()
        self.kv.reset()
        self.prefixes.clear()
        self.route_states.clear()
        for seq in seqs:
            message = f"the engine failed while serving request {seq.request_id}; the server is restarting"
            seq.handle.finish(result(seq, "error", message, 500))
        for callback in list(self.on_failure):
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - a callback must not hide the failure
                logger.exception("an on_failure callback raised")

    # --- one step ----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Expire and admit requests, prefill one round of chunks, decode one token for running rows.

        Returns:
            True while work remains.
        """
        finished: Finished = []
        with self._step_lock:
            # Threads waiting for the model (a request leasing its adapters, a reload) go first: the
            # engine would otherwise win the lock back at once, step after step.
            self.model_lock.acquire_after_others()
            try:
                with torch.inference_mode(), StepClock(self.config.count_syncs) as clock:
                    self._expire(finished)
                    self._admit(finished)
                    running = [s for s in self._active if s.phase == "decode" and s.output]
                    decoding = running
                    if running and self._waiting_for_first_tokens() and self._skipped < self.config.max_decode_skips:
                        self._skipped, decoding = self._skipped + 1, []
                    else:
                        self._skipped = 0
                    budget = self.config.max_prefill_tokens  # with no running rows it bounds each forward
                    first = self.scheduler.plan([s for s in self._active if s.phase in ("route", "fill")], budget,
                                                reserve=True, exact_budget=None if running else budget)
                    tokens, outcomes = self.scheduler.run(first, decoding)
                    rows = len(decoding)
                    for seq, outcome in outcomes:
                        self._record(seq, outcome, finished)
            finally:
                self.model_lock.release()
            if tokens or rows:
                report = StepReport(clock.seconds, tokens, rows, clock.cpu_seconds, clock.syncs, clock.sync_seconds)
                for observe in list(self.step_observers):
                    try:
                        observe(report)
                    except Exception:  # noqa: BLE001 - metrics must never stop the engine
                        logger.exception("a step observer raised")
            for handle, res in finished:
                handle.finish(res)  # done callbacks (lease releases) run without the model lock
        return self.has_work()

    def _waiting_for_first_tokens(self) -> bool:
        # Prompts whose pass has not got beyond where it began (queued with a free slot, admitted past
        # the budget, or starting in this step's first pass; a reused prefix counts as where it began).
        # A long prompt already being chunked does not count: the running rows keep decoding.
        return (any(s.phase in ("route", "fill") and s.filled == s.begun for s in self._active)
                or bool(self._waiting and self.kv.free_slots))

    def _end(self, seq: SeqState, res: GenerationResult, finished: Finished) -> None:
        if seq.slot is not None:
            self.kv.release(seq.slot, len(seq.ids) + len(seq.output))  # an upper bound of its positions
            seq.slot = None
        if seq in self._active:
            self._active.remove(seq)
        finished.append((seq.handle, res))

    def _expire(self, finished: Finished) -> None:
        now = time.monotonic()
        with self._cond:
            gone = [s for s in self._waiting if s.handle.cancel_requested or (s.deadline or now + 1) <= now]
            for seq in gone:
                self._waiting.remove(seq)
        for seq in gone + [s for s in self._active if s.handle.cancel_requested or (s.deadline or now + 1) <= now]:
            if seq.handle.cancel_requested:
                self._end(seq, result(seq, "cancelled"), finished)
            else:
                message = f"the request exceeded the server's deadline of {self.config.request_timeout_s} s"
                self._end(seq, result(seq, "error", message, 504), finished)

    def _admit(self, finished: Finished) -> None:
        while self._waiting and self.kv.free_slots:
            with self._cond:
                seq = self._waiting.popleft()
            seq.slot = self.kv.allocate()
            self._active.append(seq)
            try:
                self.lifecycle.begin_prefill(seq)
            except Exception as exc:  # noqa: BLE001 - a remembered state's weight_fn failed: this request only
                self._fail(seq, exc, finished)

    def _record(self, seq: SeqState, outcome: RowOutcome, finished: Finished) -> None:
        """Record a row's sampled token (ending its sequence when it finishes), or fail it."""
        if isinstance(outcome, Exception):
            self._fail(seq, outcome, finished)
            return
        token, logprob = outcome
        if logprob is not None:
            seq.logprobs.append(logprob)
        try:
            reason = self.lifecycle.advance(seq, token)
        except InvalidRequest as exc:  # a token its grammar refuses: this row only
            return self._fail(seq, exc, finished)
        if reason is not None:
            self._end(seq, result(seq, reason), finished)

    def _fail(self, seq: SeqState, exc: Exception, finished: Finished) -> None:
        if error_status(exc) == 500:
            logger.error("request %s failed", seq.request_id, exc_info=exc)
        self._end(seq, failed(seq, exc), finished)

    def _fingerprint(self, name: str) -> tuple[int, ...]:
        """The identity of adapter ``name``'s tensors (its first layer's): changes when they are replaced."""
        for _, layer in self.adapted.adapter_layers(name) if self.adapted is not None else ():
            a = layer.adapters[name]
            return (id(a), a.lora_A._version, a.lora_B._version)
        return ()
