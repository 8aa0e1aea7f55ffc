"""The evaluation backend over the serving stack: served targets answer, on the engine or by beam search.

The evaluator never builds adapter weights itself. It asks for *served targets* (the base model,
``global``, ``<client>`` personalised, ``<client>:local``), and :class:`serving.targets.TargetResolver`
decides what each means, exactly as for an HTTP request: FedDPA's ``<client>`` is the
instance-wise ``(1 - a, a)`` mixture of paper 000 section 4.3 when the run has its embedding index (or
the run's fixed inference weight), and any other kind of target the resolver learns (AMoLE routing)
is evaluated with no change here.

Greedy decoding (the protocol's default) runs on the continuous-batching engine
(:meth:`serving.stack.ServingStack.run`), one stream per served target: bf16 matrix products are not
batch-invariant, so a row's greedy answer can change with the rows decoded beside it; keeping each
target's rows among themselves makes its predictions independent of which other targets (methods,
clients) an evaluation runs, e.g. the ``[base]`` row is the same in every run's table. Routed
targets prefill twice (``exact_prefill``) so the first token also uses the routed weights, as the
paper's model does. The engine has no beam search, so ``num_beams > 1`` (the FedDPA reference used 4)
goes through :func:`serving.beam.generate_target` (HF ``generate``, static batches, same
targets and weights).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from adapters.rundir import RunDir
from fedmosaic.evaluation.backend import WEIGHTING, EvalItem
from fedmosaic.evaluation.inputs import EvalSetupError
from fedmosaic.evaluation.predictions import Prediction
from routing.base import Pooling
from routing.calibration import CALIBRATION_FILE
from routing.feddpa import DEFAULT_WEIGHTING, WEIGHTINGS, Mode, Variant, resolve_weighting, similarity_name
from routing.feddpa_options import FedDPAOptions, Routing
from serving.beam import GenerationConfig, generate_target
from serving.engine import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.stack import Job, ServingStack, StackConfig, build_stack
from training.algorithms import ALGORITHMS

logger = logging.getLogger(__name__)

# The engine is built short and grown to what each generate() call needs (the longest prompt plus
# max_new_tokens, capped by the model's context, rounded up so per-round evaluations rarely rebuild it):
# on CUDA the KV cache is allocated at full length, so "no cap" (2^20 positions) could not fit.
_START_LEN = 512
_LEN_STEP = 256


class StackBackend:
    """An :class:`EvalBackend` over a :class:`~serving.stack.ServingStack`.

    Args:
        stack: the serving stack holding the run's adapters.
        max_new_tokens: generation budget per answer.
        num_beams: 1 decodes greedily on the engine; more uses HF beam search.
        batch_size: engine batch rows (or beam-search batch size).
        run: the run served (its clients' index files identify routed targets' answers in the cache).
    """

    def __init__(self, stack: ServingStack, max_new_tokens: int = 64, num_beams: int = 1, batch_size: int = 8,
                 run: RunDir | None = None) -> None:
        self.stack = stack
        self.run = run
        self._digests: dict[str, str] = {}
        self.base_name = stack.base_name
        self.tokenizer = stack.loaded.tokenizer  # chat-template prompts, when the run trained with them
        self.max_new_tokens = max_new_tokens
        self.num_beams = num_beams
        self.batch_size = batch_size

    def models(self) -> list[str]:
        """Every target the stack serves."""
        return self.stack.models()

    def describe(self, target: str) -> dict[str, Any]:
        """How ``target`` is served: mode, adapters, fixed weights or routing, decoding (the cache tag)."""
        plan = self.stack.plan(target)
        routed = plan.weight_fn is not None
        decoding = "greedy" if self.num_beams == 1 else f"beams={self.num_beams}"
        out: dict[str, Any] = {"target": target, "mode": plan.mode, "adapters": list(plan.names), "routed": routed,
                               "weights": None if routed else list(plan.weights), "decoding": decoding,
                               "max_new_tokens": self.max_new_tokens}
        if plan.mode == "amole" and plan.info:  # a client's own model or the aggregated pool: never one cache
            out["amole_model"] = plan.info.get("model")
        if routed:
            out["routing"] = dict(self.stack.info)
            if plan.mode == "feddpa" and plan.client is not None and self.run is not None:
                # a routed answer depends on the client's index and calibration (its gate too): answers
                # cached before `fedmosaic calibrate` changed them are not reused
                out["index"] = self._index_digest(plan.client)
        return out

    def _index_digest(self, client: str) -> str:
        """A digest of ``client``'s index files (``embeddings*`` in its folder), read once per backend."""
        if client not in self._digests:
            digest = hashlib.sha256()
            assert self.run is not None
            for path in sorted(self.run.client_dir(client).glob("embeddings*")):
                if path.is_file():
                    digest.update(path.name.encode() + b"\0" + path.read_bytes())
            self._digests[client] = digest.hexdigest()[:16]
        return self._digests[client]

    def generate(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, Prediction]]:
        """Answer every item, one engine stream per target (greedy) or HF beam search; yields as done.

        Raises:
            RuntimeError: a generation failed or was cancelled (the message names the item).
        """
        if self.num_beams > 1:
            yield from self._beams(items)
            return
        self._fit(items)
        sampling = SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0)
        for group in _by_target(items).values():
            jobs = (Job(target=it.target, sampling=sampling, prompt=it.prompt, exact_prefill=True, key=it)
                    for it in group)
            for outcome in self.stack.run(jobs):
                item: EvalItem = outcome.job.key
                if outcome.error is not None:
                    raise RuntimeError(f"{item.key}/{item.task} example {item.i}: {outcome.error}") from outcome.error
                assert outcome.result is not None
                if outcome.result.finish_reason in ("error", "cancelled"):
                    raise RuntimeError(f"{item.key}/{item.task} example {item.i}: generation "
                                       f"{outcome.result.finish_reason}: {outcome.result.error}")
                yield item, _prediction(outcome.result.text, outcome.weights(), outcome.result.route_info)

    def _fit(self, items: Sequence[EvalItem]) -> None:
        """Size the engine's KV cache for ``items``: the longest prompt plus ``max_new_tokens`` (the
        engine tokenizes a prompt the same way), rounded up, capped by the model's context."""
        if not items:
            return
        ids = self.tokenizer([it.prompt for it in items], add_special_tokens=False)["input_ids"]
        need = max(len(x) for x in ids) + self.max_new_tokens
        self.stack.fit_length(-(-need // _LEN_STEP) * _LEN_STEP)

    def _beams(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, Prediction]]:
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, num_beams=self.num_beams,
                                  batch_size=self.batch_size)
        for target, group in _by_target(items).items():
            for start in range(0, len(group), self.batch_size):
                chunk = group[start:start + self.batch_size]
                outs = generate_target(self.stack, target, [it.prompt for it in chunk], config)
                for it, out in zip(chunk, outs, strict=True):
                    yield it, _prediction(out.text, out.weights, out.info)

    def add_adapter(self, name: str, folder: Path) -> None:
        """Load the PEFT folder ``folder`` into the pool as ``name`` (replacing one of that name)."""
        self.stack.pool.load(name, folder, replace=True)

    def remove_adapter(self, name: str) -> None:
        """Unload ``name`` from the pool."""
        self.stack.pool.unload(name)


def _by_target(items: Sequence[EvalItem]) -> dict[str, list[EvalItem]]:
    """Items grouped by served target, in first-seen order (each group keeps the items' order)."""
    groups: dict[str, list[EvalItem]] = {}
    for it in items:
        groups.setdefault(it.target, []).append(it)
    return groups


def _prediction(text: str, weights: dict[str, float], info: Any) -> Prediction:
    extra: dict[str, Any] = {}
    if weights:
        extra["weights"] = weights
    if info:
        extra["route"] = dict(info)
    return Prediction(text.strip(), extra)


def feddpa_routing(cfg: dict[str, Any], run: RunDir, weighting: str) -> Routing:
    """``instance`` or ``fixed``: how ``<client>`` targets of this run are evaluated.

    ``auto`` follows the evaluation protocol: the personalised model of a method registered with
    ``instance_weighting`` (FedDPA, :class:`training.protocol.Method`) uses the instance-wise weight of
    paper 000 section 4.3 when the run has its embedding index; other methods (whose personalised model
    is a fixed mixture, e.g. the local adapter alone) use the fixed weight.

    Raises:
        EvalSetupError: ``instance`` asked for but the run has no embedding index.
        ValueError: an unknown mode.
    """
    if weighting not in WEIGHTING:
        raise ValueError(f"FedDPA weighting must be one of {WEIGHTING}, got {weighting!r}")
    has_index = any(run.embeddings(c).is_file() for c in run.clients())
    if weighting == "instance" and not has_index:
        raise EvalSetupError(f"instance-wise FedDPA weights need the run's embedding index "
                         f"(adapters/clients/<id>/embeddings.npy); {run.root} has none: use 'fixed'")
    if weighting == "auto":
        method = ALGORITHMS.get(str(cfg.get("method", "")).lower())
        return "instance" if method is not None and method.instance_weighting and has_index else "fixed"
    return cast(Routing, weighting)  # instance or fixed: one of WEIGHTING, auto handled above


def open_backend(run: RunDir, cfg: dict[str, Any], *, model: str | None = None, dtype: str | None = None,
                 device: str | None = None, max_new_tokens: int = 64, num_beams: int = 1, batch_size: int = 8,
                 weighting: str = "auto", samples: int = 5, mode: str = "random", rule: str | None = None,
                 similarity: str = "cosine", variant: str = "paper", embedding: str = "last") -> StackBackend:
    """Build the serving stack over ``run`` and wrap it for evaluation.

    ``rule`` (``--feddpa-weighting``): ``paper`` or ``calibrated`` ask for instance-wise weights with
    that rule, ``fixed`` for the fixed weight; None leaves ``weighting`` to decide, with the default rule
    (the paper's for an ablation of it: ``similarity`` other than cosine, ``variant`` reference).
    ``embedding`` (``last`` or ``mean``) must match how the run's indexes were pooled.

    Raises:
        EvalSetupError: ``calibrated`` asked for but a client's calibration file is missing (with no rule
            given, such a run is evaluated with the paper's rule).
        RoutingError: ``calibrated`` asked for with an ablation of the paper's rule, or indexes pooled
            otherwise than ``embedding`` (the message names `fedmosaic calibrate`).
    """
    if rule == "fixed":
        weighting = "fixed"
    elif rule is not None and weighting == "auto":
        weighting = "instance"
    routing = feddpa_routing(cfg, run, weighting)
    chosen = resolve_weighting(rule if rule in WEIGHTINGS else None, similarity, variant) \
        if routing == "instance" else DEFAULT_WEIGHTING
    missing = [c for c in run.clients()
               if run.embeddings(c).is_file() and not (run.client_dir(c) / CALIBRATION_FILE).is_file()]
    if routing == "instance" and chosen == "calibrated" and missing:
        if rule is None:  # the default on a run trained before calibrations: the paper's rule, said so
            logger.warning("%s has no FedDPA calibration: evaluating with the paper's rule "
                           "(`fedmosaic calibrate %s` adds it)", run.root, run.root)
            chosen = "paper"
        else:
            raise EvalSetupError(f"calibrated FedDPA weights need each client's {CALIBRATION_FILE}; clients "
                             f"{missing} of {run.root} have none: run `fedmosaic calibrate {run.root}` "
                             "(or --feddpa-weighting paper)")
    config = StackConfig(
        model=model or cfg.get("model", "smollm2"), dtype=dtype, device=device, run_dir=run.root,
        max_loras=len(run.clients()) + 4,
        engine=EngineConfig(max_batch_size=batch_size, max_model_len=_START_LEN, max_waiting=max(64, 4 * batch_size)),
        # text options: FedDPAOptions checks each against its choices on construction (RoutingError)
        feddpa=FedDPAOptions(routing=routing, weighting=chosen if routing == "instance" else None, samples=samples,
                             mode=cast(Mode, mode), similarity=similarity_name(similarity),
                             variant=cast(Variant, variant), embedding=cast(Pooling, embedding)),
        check_base=False)
    stack = build_stack(config)
    if routing == "instance" and stack.routing != "instance":
        raise EvalSetupError(f"instance-wise FedDPA weights were asked for but {run.root} gave no embedding index")
    return StackBackend(stack, max_new_tokens=max_new_tokens, num_beams=num_beams, batch_size=batch_size, run=run)
