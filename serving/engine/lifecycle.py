"""A request's life in the engine: validation, prefill phases, routing, each new token.

:class:`Lifecycle` is the part of a request's life that needs no scheduling (the engine owns one and
hands it to its scheduler): it turns a
:class:`~serving.engine.request.GenerationRequest` into a validated :class:`~serving.engine.sequence.SeqState`,
chooses the prefill phases (a FedDPA request first prefills with its prefill weights and hands its
final-layer state to ``weight_fn``, paper 000 section 4.3), and records every sampled token (stop
strings, end of sequence, length limits).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from serving.engine.config import EngineConfig
from serving.engine.request import FinishReason, GenerationRequest, RequestHandle
from serving.engine.runner.inputs import RowAdapters
from serving.engine.sampling import make_generator, token_logprobs
from serving.engine.sequence import SeqState
from serving.engine.text import TextTracker
from serving.errors import AdapterNotFound, InvalidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from serving.engine.executor import RowOut
    from serving.engine.prefix_cache import PrefixCache
    from serving.engine.route_states import RouteStates
    from serving.engine.runner.inputs import PrefillRow


class Lifecycle:
    """Request validation and phase changes, over the engine's settings, tokenizer and prefix cache.

    Args:
        config: the engine's limits (the prompt's length, the request's deadline).
        tokenizer: the base model's tokenizer.
        adapted: the injected adapter handle (None: base model only); names the loaded adapters.
        vocab_size: the model's vocabulary size (token ids must lie below it).
        eos_ids: the end-of-sequence token ids.
        device: where a request's seeded generator lives.
        prefixes: the prefix cache a prompt pass reuses from and is remembered in.
        states: routing states remembered by prompt (None: every routed prompt runs its routing pass).
    """

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, adapted: object, vocab_size: int,
                 eos_ids: frozenset[int], device: torch.device, prefixes: PrefixCache,
                 states: RouteStates | None = None) -> None:
        self.config, self.tokenizer, self.adapted = config, tokenizer, adapted
        self.vocab_size, self.eos_ids, self.device, self.prefixes = vocab_size, eos_ids, device, prefixes
        self.states = states

    @staticmethod
    def row_adapters(seq: SeqState, weights: tuple[float, ...]) -> RowAdapters:
        """The adapters a phase of ``seq`` runs with (its AMoLE route, or its names at ``weights``)."""
        if seq.amole is not None:
            return RowAdapters(amole=seq.amole)
        return RowAdapters(tuple(seq.handle.request.adapter_names), weights)

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except (UnicodeError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"the prompt is not valid text ({type(exc).__name__}: {exc}); send UTF-8 "
                                 "text without lone surrogates", param="prompt") from exc

    def prepare(self, request: GenerationRequest) -> SeqState:
        """Validate ``request`` and make its waiting sequence (raises the errors of ``submit``)."""
        ids = list(request.prompt_ids) if request.prompt_ids is not None else self._encode(request.prompt or "")
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization", param="prompt")
        if any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        vocab_ids = [t for t, _ in request.sampling.logit_bias] + list(request.sampling.stop_token_ids)
        if any(t >= self.vocab_size for t in vocab_ids):
            raise InvalidRequest(f"logit_bias and stop_token_ids take token ids below the vocabulary size "
                                 f"{self.vocab_size}", param="logit_bias")
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; this server allows {self.config.max_model_len} "
                "tokens of prompt plus completion", param="prompt")
        loaded = set(getattr(self.adapted, "configs", {}) or {})
        missing = [n for n in request.adapter_names if n not in loaded]
        if missing:
            raise AdapterNotFound(f"adapters {missing} are not loaded in the model")
        route = request.route
        if route is not None and any(n not in loaded for n in route.bundle.adapter_names):
            raise AdapterNotFound(f"the AMoLE version {route.bundle.internal!r} is no longer loaded")
        params = request.sampling
        try:
            generator = make_generator(params, self.device)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"seed {params.seed!r} cannot seed a generator: {exc}", param="seed") from exc
        timeout = self.config.request_timeout_s
        seq = SeqState(handle=RequestHandle(request), ids=ids, tracker=TextTracker(self.tokenizer, params.stop),
                       generator=generator, deadline=time.monotonic() + timeout if timeout else None,
                       weights=tuple(request.adapter_weights), amole=route,
                       matcher=params.grammar.matcher() if params.grammar is not None else None)
        if route is not None:
            seq.info = route.info()
        if request.shared_prefix and request.prompt_ids is None and (request.prompt or "").startswith(
                request.shared_prefix):
            shared = self._encode(request.shared_prefix)
            seq.public = next((i for i, (a, b) in enumerate(zip(shared, ids, strict=False)) if a != b),
                              min(len(shared), len(ids)))
        return seq

    def begin_prefill(self, seq: SeqState) -> None:
        """Enter the first prefill phase (``route`` for a routed request, else ``fill``).

        A routed prompt whose routing state is remembered (:mod:`serving.engine.route_states`) is routed
        at once and enters ``fill`` at its routed weights.

        Raises:
            Exception: whatever ``weight_fn`` raises for a remembered state (the engine fails the request with it).
        """
        req = seq.handle.request
        seq.filled, seq.state_sum = 0, None
        if seq.amole is not None:
            index = {p: i for i, p in enumerate(getattr(self.adapted, "layers", {}))}
            seq.layer_idx = torch.tensor([index[p] for p in seq.amole.bundle.layers])
            seq.phase, seq.adapters = "fill", self.row_adapters(seq, (1.0,))
        elif req.weight_fn is not None:
            first = tuple(req.prefill_weights if req.prefill_weights is not None else req.adapter_weights)
            seq.phase, seq.adapters = "route", self.row_adapters(seq, first)
            state = self._remembered(seq)
            if state is not None:  # routed before: straight to the pass at the routed weights
                self._route(seq, state)
                seq.phase, seq.adapters = "fill", self.row_adapters(seq, seq.weights)
        else:
            seq.phase, seq.adapters = "fill", self.row_adapters(seq, tuple(req.adapter_weights))
        self._reuse_prefix(seq)

    def _reuse_prefix(self, seq: SeqState) -> None:
        """Start a prompt pass after the longest cached prefix of the prompt under the pass's weights.

        A routing pass reuses one too (FedDPA's is the global adapter alone, shared by every client's
        requests): its last token's state then differs from a full pass's by float rounding only, and
        the seeded random FedDPA draw keys on the prompt's ids, not on the state. Not a routing pass
        pooling the mean state (the reused positions' states are not computed), and not when the
        prompt's log-probabilities are asked for (every position's logits are needed).
        """
        req = seq.handle.request
        pooled = seq.phase == "route" and req.state_pooling != "last"
        if seq.slot is not None and req.sampling.prompt_logprobs is None and not pooled:
            seq.filled = self.prefixes.reuse(seq.adapters, seq.ids, seq.slot, req.cache_scope, seq.public)
        seq.begun = seq.filled

    def prefilled(self, seq: SeqState, out: RowOut) -> bool:
        """A chunk of the prompt went through; True when its first token is sampled from ``out``.

        A routing pass adds up the chunks' final-layer states; once the whole prompt went through,
        ``weight_fn`` gets the last token's state or their mean (``state_pooling``).

        Raises:
            InvalidRequest: when ``weight_fn`` returns the wrong number of weights.
            Exception: whatever ``weight_fn`` raises; the engine fails the sequence with it.
        """
        req = seq.handle.request
        if seq.phase == "route" and req.state_pooling == "mean":
            assert out.state_sum is not None
            seq.state_sum = out.state_sum if seq.state_sum is None else seq.state_sum + out.state_sum
        if seq.filled < len(seq.ids):
            return False
        if seq.slot is not None:  # a routed request's fill pass is its exact pass, at weights routed for its prompt
            own = req.weight_fn is not None and seq.phase == "fill"
            self.prefixes.remember(seq.adapters, seq.ids, seq.slot, own=own, scope=req.cache_scope, public=seq.public)
        if seq.phase == "route":
            assert req.weight_fn is not None and out.state is not None
            if req.state_pooling == "last":
                state = out.state
            else:  # the mean: the sum over the route pass's chunks (every chunk added it above)
                assert seq.state_sum is not None
                state = seq.state_sum / len(seq.ids)
            if self.states is not None:
                self.states.put(self.prefixes.key(seq.adapters), req.cache_scope, req.state_pooling, seq.ids, state)
            weights = self._route(seq, state)
            first = tuple(req.prefill_weights if req.prefill_weights is not None else req.adapter_weights)
            # Routed to the prefill's own weights (calibrated FedDPA's a = 0 for an unrelated prompt): this
            # pass already is the exact one, unless the prompt's log-probabilities were asked for.
            again = weights != tuple(float(w) for w in first) or req.sampling.prompt_logprobs is not None
            if req.exact_prefill and again:
                seq.phase, seq.filled, seq.adapters = "fill", 0, self.row_adapters(seq, weights)
                self._reuse_prefix(seq)
                return False
            seq.adapters = self.row_adapters(seq, weights)
        seq.phase = "decode"
        return True

    def _remembered(self, seq: SeqState) -> torch.Tensor | None:
        """The remembered state of ``seq``'s routing pass, for an exact request not asking for every logit.

        A request without ``exact_prefill`` keeps its routing pass: that pass's KV is the one it decodes
        from, so skipping it would change its answer.
        """
        req = seq.handle.request
        if self.states is None or not req.exact_prefill or req.sampling.prompt_logprobs is not None:
            return None
        return self.states.get(self.prefixes.key(seq.adapters), req.cache_scope, req.state_pooling, seq.ids)

    def _route(self, seq: SeqState, state: torch.Tensor) -> tuple[float, ...]:
        """Hand the routing state to ``weight_fn``; records and returns the routed weights.

        Raises:
            Whatever ``weight_fn`` raises, and InvalidRequest when it returns the wrong number of weights.
        """
        req = seq.handle.request
        assert req.weight_fn is not None
        routed, info = req.weight_fn(state.cpu(), seq.ids)
        weights = tuple(float(w) for w in routed)
        if len(weights) != len(req.adapter_names):
            raise InvalidRequest(f"weight_fn returned {len(weights)} weights for {req.adapter_names}")
        seq.weights, seq.info = weights, dict(info)
        return weights

    def record_prompt_logprobs(self, seq: SeqState, row: PrefillRow, logits: torch.Tensor) -> None:
        """Prompt tokens' log-probabilities from a chunk's (n, V) logits: position p predicts token p + 1."""
        if row.start == 0:
            seq.prompt_logprobs = [None]  # nothing predicts the first token (a re-prefill starts over)
        k = int(seq.handle.request.sampling.prompt_logprobs or 0)
        nxt = [seq.ids[p + 1] for p in range(row.start, row.end) if p + 1 < len(seq.ids)]  # the last: a completion's
        seq.prompt_logprobs += token_logprobs(logits[: len(nxt)], nxt, [k] * len(nxt))

    def advance(self, seq: SeqState, token: int) -> FinishReason | None:
        """Record one generated token, stream its text, and say whether the sequence is finished.

        Raises:
            InvalidRequest: the row's grammar does not allow ``token`` (the engine fails the row with it).
        """
        params = seq.handle.request.sampling
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic() - seq.submitted
        if seq.matcher is not None:
            seq.matcher.accept(token)
        seq.output.append(token)
        ended = seq.matcher is not None and seq.matcher.done  # the grammar took its end: no ignore_eos past it
        if ended or (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.handle.push(seq.tracker.flush())
            return "stop"
        delta, stopped = seq.tracker.push(token)
        seq.handle.push(delta)
        if stopped:
            return "stop"
        if len(seq.output) >= params.max_tokens or seq.prompt_len + len(seq.output) >= self.config.max_model_len:
            seq.handle.push(seq.tracker.flush())
            return "length"
        seq.next_token = token
        return None
