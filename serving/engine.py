"""The continuous-batching engine: one frozen base model, per-row adapter weights, streaming, cancel.

Requests wait in a queue and join the running batch between decode steps. A joining request is
prefilled alone (its own KV cache, so its prompt pass equals a solo run) and its cache is merged into
the batch cache with left padding (:mod:`serving.kv`); every decode step then runs one forward over all
rows, each with its own adapter weights through the model's adapter context (DESIGN.md, the one
contract), so one batch mixes clients. Rows leave as soon as they finish or are cancelled.

Routing hook (FedDPA, paper 000 section 4.3): a request with ``weight_fn`` is prefilled with its
``prefill_weights`` (the global adapter alone) and ``output_hidden_states``; the final-layer state of
its last prompt token goes to ``weight_fn``, whose weights serve every decode step. The prompt's KV
cache and first token therefore come from the global adapter unless ``exact_prefill`` asks for a
second prefill with the routed weights.

AMoLE (paper 002 section 4.2): a request naming an AMoLE route (``<model>@<version>/<client>``, what a
pool lease gives for an AMoLE client; :mod:`serving.amole_router`) is routed per token inside the
layers over that client's experts. Its rows share decode steps with other clients' AMoLE rows, plain
adapter rows and base rows (group -1 of the batch's routing). An :class:`~adapters.context.ExpertRecorder`
counts, per layer, the top-k experts of every position that produced a generated token; the result's
``route_info["expert_usage"]`` reports them.

Drive it with :meth:`Engine.step` (explicit loop, tests, batch runs) or :meth:`Engine.start` (a
background thread calling ``step``). Python use needs no HTTP::

    engine = Engine(loaded, adapted)
    handle = engine.submit(GenerationRequest(prompt="Hi", sampling=SamplingParams(temperature=0)))
    engine.generate([...])          # or: engine.start(); handle.result(); engine.stop()
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from adapters import AdaptedModel
from adapters.context import AMoLERouting, ExpertRecorder
from fedmosaic.models import LoadedModel
from serving.amole_router import AMoLEClientRoute, AMoLERegistry, batch_routing, registry_for, usage_report
from serving.errors import AdapterNotFound, EngineNotReady, EngineOverloaded, InvalidRequest
from serving.kv import BatchKV, cache_to_layers
from serving.request import FinishReason, GenerationRequest, GenerationResult, RequestHandle
from serving.sampling import TextTracker, make_generator, sample


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits.

    Attributes:
        max_batch_size: rows decoded together at most; later requests wait.
        max_model_len: prompt plus completion tokens at most per request.
        max_waiting: queued requests at most; beyond it :meth:`Engine.submit` raises EngineOverloaded.
    """

    max_batch_size: int = 8
    max_model_len: int = 2048
    max_waiting: int = 256

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_model_len", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: waiting and running requests, batch cache length."""

    waiting: int
    running: int
    kv_length: int


@dataclass(eq=False)
class _Row:
    """A running sequence (engine-internal, mutated every step)."""

    handle: RequestHandle
    prompt_len: int
    weights: tuple[float, ...]
    generator: torch.Generator | None
    tracker: TextTracker
    info: dict[str, Any] = field(default_factory=dict)
    output: list[int] = field(default_factory=list)
    next_token: int = -1
    amole: AMoLEClientRoute | None = None
    usage: torch.Tensor | None = None  # (bundle layers, num_experts) top-k selections so far
    layer_idx: torch.Tensor | None = None  # the bundle's layers among the engine's layer paths


class Engine:
    """Continuous batching over one frozen model with named adapters.

    Args:
        loaded: the base model, tokenizer and compute-dtype policy.
        adapted: the injected adapter handle (None: base model only).
        config: batch and length limits.
        model_lock: lock held for every forward; the adapter pool holds the same lock while it
            changes the model's adapters, so a forward never sees a half-loaded adapter.
        amole: where AMoLE route names resolve (default: the model's registry, shared with its pool).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        adapted: AdaptedModel | None = None,
        config: EngineConfig = EngineConfig(),
        model_lock: threading.RLock | None = None,
        amole: AMoLERegistry | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.adapted = adapted
        self.config = config
        self.model_lock = model_lock if model_lock is not None else threading.RLock()
        self.amole = amole if amole is not None else (registry_for(adapted) if adapted is not None else None)
        self._paths = tuple(adapted.layers) if adapted is not None else ()
        # The tokenizer's eos and the generation config's (chat models often list several).
        eos: set[int] = set()
        for value in (getattr(self.tokenizer, "eos_token_id", None),
                      getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)):
            eos.update([value] if isinstance(value, int) else (value or []))
        self.eos_ids = frozenset(eos)
        self._waiting: deque[tuple[RequestHandle, list[int]]] = deque()
        self._rows: list[_Row] = []
        self._kv = BatchKV()
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- submission ----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; it joins the batch at the next step.

        Raises:
            InvalidRequest: the prompt is empty or too long for ``max_model_len``.
            AdapterNotFound: an adapter name is not loaded in the model.
            EngineOverloaded: the waiting queue is full.
            EngineNotReady: the engine was stopped.
        """
        if self._stopping:
            raise EngineNotReady("the engine is stopped")
        ids = list(request.prompt_ids) if request.prompt_ids is not None else self._encode(request.prompt or "")
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization", param="prompt")
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; this server allows {self.config.max_model_len} "
                "tokens of prompt plus completion", param="messages")
        loaded = set(self.adapted.configs) if self.adapted is not None else set()
        missing = [n for n in request.adapter_names if n not in loaded and self._route(n) is None]
        if missing:
            raise AdapterNotFound(f"adapters {missing} are not loaded in the model")
        self._amole_route(request)  # validates how an AMoLE route is asked for
        handle = RequestHandle(request)
        with self._cond:
            if len(self._waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests are already waiting; retry later")
            self._waiting.append((handle, ids))
            self._cond.notify_all()
        return handle

    def _route(self, name: str) -> AMoLEClientRoute | None:
        return self.amole.route(name) if self.amole is not None and "/" in name else None

    def _amole_route(self, request: GenerationRequest) -> AMoLEClientRoute | None:
        """The request's AMoLE route, or None; an AMoLE route must be the only adapter, at weight 1."""
        routes = [r for r in map(self._route, request.adapter_names) if r is not None]
        if not routes:
            return None
        if len(request.adapter_names) != 1 or tuple(request.adapter_weights) != (1.0,) or request.weight_fn:
            raise InvalidRequest("an AMoLE client routes every token itself: request it alone, at weight 1, "
                                 "without a weight_fn", param="adapters")
        return routes[0]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion (stepping here unless the background thread runs)."""
        handles = [self.submit(r) for r in requests]
        if not self.running:
            while not all(h.done for h in handles):
                self.step()
        return [h.result() for h in handles]

    def stats(self) -> EngineStats:
        """Current queue and batch sizes."""
        return EngineStats(waiting=len(self._waiting), running=len(self._rows), kv_length=self._kv.length)

    def has_work(self) -> bool:
        """True while requests wait or run."""
        return bool(self._waiting or self._rows)

    # --- background thread ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the background thread drives the engine."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the background thread that calls :meth:`step` whenever there is work."""
        if self.running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fedmosaic-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still waiting or running finish as ``cancelled``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for handle, _ in list(self._waiting):
            handle.cancel()
        for row in self._rows:
            row.handle.cancel()
        while self.has_work():
            self.step()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self.has_work())
                if self._stopping:
                    return
            self.step()

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit waiting requests (prefill), run one decode step over the batch, retire finished rows.

        Returns:
            True while work remains.
        """
        finished: list[tuple[RequestHandle, GenerationResult]] = []
        with self._step_lock:
            with self.model_lock, torch.inference_mode():
                self._retire_cancelled(finished)
                self._admit(finished)
                if self._rows:
                    self._decode(finished)
        # Done callbacks (e.g. releasing adapter leases) run without the model lock held.
        for handle, result in finished:
            handle.finish(result)
        return self.has_work()

    def _forward(self, names: tuple[str, ...], weights: torch.Tensor, routing: AMoLERouting | None = None,
                 **kwargs: Any) -> Any:
        if self.adapted is not None and routing is not None:
            ctx: Any = self.adapted.context.route_amole(routing, names, weights if names else None)
        elif self.adapted is not None and names:
            ctx = self.adapted.context.use(names, weights)
        else:
            ctx = contextlib.nullcontext()
        with ctx, self.loaded.autocast():
            return self.model(**kwargs)

    def _retire_cancelled(self, finished: list[tuple[RequestHandle, GenerationResult]]) -> None:
        with self._cond:
            kept = deque(item for item in self._waiting if not item[0].cancel_requested)
            for handle, ids in self._waiting:
                if handle.cancel_requested:
                    finished.append((handle, _empty_result(handle, len(ids), "cancelled")))
            self._waiting = kept
        keep = [i for i, row in enumerate(self._rows) if not row.handle.cancel_requested]
        if len(keep) < len(self._rows):
            for row in self._rows:
                if row.handle.cancel_requested:
                    finished.append((row.handle, self._result(row, "cancelled")))
            self._rows = [self._rows[i] for i in keep]
            self._kv.keep(keep)

    def _admit(self, finished: list[tuple[RequestHandle, GenerationResult]]) -> None:
        while len(self._rows) < self.config.max_batch_size:
            with self._cond:
                if not self._waiting:
                    return
                handle, ids = self._waiting.popleft()
            try:
                row, layers, logits = self._prefill(handle, ids)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the batch
                finished.append((handle, _empty_result(handle, len(ids), "error", str(exc))))
                continue
            reason = self._advance(row, sample(logits, handle.request.sampling, row.generator))
            if reason is not None:
                finished.append((handle, self._result(row, reason)))
                continue
            self._rows.append(row)
            self._kv.add(layers)

    def _prefill(self, handle: RequestHandle, ids: list[int]) -> tuple[_Row, Any, torch.Tensor]:
        """Prefill one request alone; return its row, per-layer K/V (1, H, n, D) and (V,) logits."""
        req = handle.request
        input_ids = torch.tensor([ids])  # (1, n)
        weights, info = tuple(req.adapter_weights), {}
        route = self._amole_route(req)
        if route is not None:
            return self._prefill_amole(handle, ids, route)
        if req.weight_fn is not None:
            first = tuple(req.prefill_weights if req.prefill_weights is not None else req.adapter_weights)
            out = self._forward(req.adapter_names, torch.tensor([first]), input_ids=input_ids,
                                use_cache=True, output_hidden_states=True, logits_to_keep=1)
            state = out.hidden_states[-1][0, -1].float()  # (H,)
            routed, info = req.weight_fn(state)
            weights = tuple(float(w) for w in routed)
            if len(weights) != len(req.adapter_names):
                raise InvalidRequest(f"weight_fn returned {len(weights)} weights for {req.adapter_names}")
            if req.exact_prefill:
                out = self._forward(req.adapter_names, torch.tensor([weights]), input_ids=input_ids,
                                    use_cache=True, logits_to_keep=1)
        else:
            out = self._forward(req.adapter_names, torch.tensor([weights]), input_ids=input_ids,
                                use_cache=True, logits_to_keep=1)
        row = _Row(handle=handle, prompt_len=len(ids), weights=weights,
                   generator=make_generator(req.sampling),
                   tracker=TextTracker(self.tokenizer, req.sampling.stop), info=dict(info))
        return row, cache_to_layers(out.past_key_values), out.logits[0, -1]

    def _prefill_amole(self, handle: RequestHandle, ids: list[int],
                       route: AMoLEClientRoute) -> tuple[_Row, Any, torch.Tensor]:
        """Prefill an AMoLE request; its last position's expert choices count for the first token."""
        recorder = ExpertRecorder()
        out = self._forward((), torch.zeros(1, 0), routing=batch_routing([route], recorder),
                            input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        index = {p: i for i, p in enumerate(self._paths)}
        layer_idx = torch.tensor([index[p] for p in route.bundle.layers])
        counts = recorder.counts(self._paths, route.bundle.num_experts, 1, last_token=True)[0]  # (L, E)
        params = handle.request.sampling
        row = _Row(handle=handle, prompt_len=len(ids), weights=(1.0,), generator=make_generator(params),
                   tracker=TextTracker(self.tokenizer, params.stop), info=route.info(),
                   amole=route, usage=counts[layer_idx], layer_idx=layer_idx)
        return row, cache_to_layers(out.past_key_values), out.logits[0, -1]

    def _decode(self, finished: list[tuple[RequestHandle, GenerationResult]]) -> None:
        names: dict[str, int] = {}
        for row in self._rows:
            if row.amole is None:
                for name in row.handle.request.adapter_names:
                    names.setdefault(name, len(names))
        weights = torch.zeros(len(self._rows), len(names))  # (B, K) over the union of the plain rows' adapters
        for b, row in enumerate(self._rows):
            if row.amole is None:
                for name, w in zip(row.handle.request.adapter_names, row.weights, strict=True):
                    weights[b, names[name]] = w
        routes = [row.amole for row in self._rows]
        recorder = ExpertRecorder() if any(r is not None for r in routes) else None
        input_ids = torch.tensor([[row.next_token] for row in self._rows])  # (B, 1)
        out = self._forward(tuple(names), weights, routing=batch_routing(routes, recorder), input_ids=input_ids,
                            attention_mask=self._kv.step_mask(), position_ids=self._kv.next_positions(),
                            past_key_values=self._kv.as_hf_cache(), use_cache=True)
        self._kv.after_step(out.past_key_values)
        if recorder is not None:
            experts = max(r.bundle.num_experts for r in routes if r is not None)
            counts = recorder.counts(self._paths, experts, len(self._rows))  # (B, L, E_max)
            for b, row in enumerate(self._rows):
                if row.amole is not None and row.usage is not None:
                    row.usage += counts[b, row.layer_idx, : row.amole.bundle.num_experts]
        logits = out.logits[:, -1]  # (B, V)
        keep: list[int] = []
        for b, row in enumerate(self._rows):
            reason = self._advance(row, sample(logits[b], row.handle.request.sampling, row.generator))
            if reason is None:
                keep.append(b)
            else:
                finished.append((row.handle, self._result(row, reason)))
        if len(keep) < len(self._rows):
            self._rows = [self._rows[b] for b in keep]
            self._kv.keep(keep)

    def _advance(self, row: _Row, token: int) -> FinishReason | None:
        """Record one generated token, stream its text, and say whether the row is finished."""
        params = row.handle.request.sampling
        row.output.append(token)
        if token in self.eos_ids and not params.ignore_eos:
            row.handle.push(row.tracker.flush())
            return "stop"
        delta, stopped = row.tracker.push(token)
        row.handle.push(delta)
        if stopped:
            return "stop"
        if len(row.output) >= params.max_tokens or row.prompt_len + len(row.output) >= self.config.max_model_len:
            row.handle.push(row.tracker.flush())
            return "length"
        row.next_token = token
        return None

    def _result(self, row: _Row, reason: FinishReason) -> GenerationResult:
        req = row.handle.request
        if row.amole is not None and row.usage is not None:
            row.info["expert_usage"] = usage_report(row.amole, row.usage, len(row.output))
        return GenerationResult(
            request_id=req.request_id, text=row.tracker.text[: row.tracker.emitted] if reason == "cancelled"
            else row.tracker.text, token_ids=tuple(row.output), finish_reason=reason,
            prompt_tokens=row.prompt_len, completion_tokens=len(row.output), adapter_names=req.adapter_names,
            adapter_weights=row.weights, route_info=row.info)


def _empty_result(handle: RequestHandle, prompt_tokens: int, reason: FinishReason,
                  error: str | None = None) -> GenerationResult:
    req = handle.request
    return GenerationResult(request_id=req.request_id, text="", token_ids=(), finish_reason=reason,
                            prompt_tokens=prompt_tokens, completion_tokens=0, adapter_names=req.adapter_names,
                            adapter_weights=tuple(req.adapter_weights), error=error)
