"""The serving stack without HTTP: base model, adapter pool, target resolver and engine, built once.

The HTTP app (:mod:`serving.api`), the batch runner (:mod:`serving.batch`), the batch evaluator
(``fedmosaic eval``) and the benchmarks all build this one stack and ask for *served targets* by name
(the base model, ``global``, ``<client>`` personalised, ``<client>:local``, any loaded adapter;
docs/serving.md). What a name means is decided in one place, :class:`serving.targets.TargetResolver`
(FedDPA's instance-wise weighting of paper 000 section 4.3 for ``<client>`` when the run has its
embedding index), and a resolved plan becomes an engine request in one place, :func:`request_for`, so
a new kind of target (AMoLE routing, paper 002) reaches every caller at once.

:meth:`ServingStack.run` drives many jobs through the engine with continuous batching: it keeps a
window of requests in flight, steps the engine in the caller's thread (or waits on the background
thread when one runs) and yields each outcome as soon as it finishes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from adapters import AdaptedModel, inject
from adapters.config import Targets
from adapters.targets import parse_targets
from models import LoadedModel, load_base_model
from models.settings import DType
from routing.base import local_name
from routing.feddpa_options import FedDPAOptions
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest, GenerationResult, RequestHandle
from serving.engine.sampling import SamplingParams
from serving.pool import AdapterPool, Lease, RunInfo
from serving.pool.targets import served_targets
from serving.settings import ServeSettings
from serving.targets import TargetPlan, TargetResolver, WeightRouter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StackConfig:
    """What to load and how to serve it.

    Attributes:
        model: base model: ``smollm2``, ``tiny``, or an HF model folder.
        served_model_name: the base model's target name (default: ``model``).
        model_aliases: more target names of the base model.
        dtype: ``float32``, ``bfloat16`` or ``autocast-bf16`` (None: the setting's default).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (None: ``FEDMOSAIC_DEVICE``, default auto).
        run_dir: a training run directory to serve (``global`` and every ``<client>:local``).
        adapters: extra adapters as ``name=folder``.
        adapter_root: adapter folders must resolve inside it (default: the run directory, else the
            common parent of ``adapters``).
        target_modules: Linear layers to adapt besides the served adapters' own targets (None: only theirs,
            ``q_proj``/``v_proj`` when there are none; :mod:`serving.pool.targets`).
        max_loras: adapters loaded at once (LRU beyond).
        engine: batch and length limits of the engine.
        feddpa: how ``<client>`` targets are weighted (:class:`~routing.feddpa_options.FedDPAOptions`,
            each option's one definition): instance-wise from the run's embeddings (needs
            ``embeddings.npy``) or the run's fixed ``inference_weight``.
        default_alpha: the fixed local weight when the run records none.
        check_base: refuse adapters trained on another base model.
    """

    model: str = "smollm2"
    served_model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    dtype: str | None = None
    device: str | None = None
    run_dir: Path | None = None
    adapters: tuple[str, ...] = ()
    adapter_root: Path | None = None
    target_modules: Targets | None = None
    max_loras: int = 16
    engine: EngineConfig = EngineConfig()
    feddpa: FedDPAOptions = FedDPAOptions()
    default_alpha: float = 0.5
    check_base: bool = True

    def __post_init__(self) -> None:
        bad = [s for s in self.adapters if "=" not in s or not s.partition("=")[0] or not s.partition("=")[2]]
        if bad:
            raise ValueError(f"adapters must be given as name=folder, got {bad}")

    @property
    def base_name(self) -> str:
        """The target name of the bare base model."""
        return self.served_model_name or self.model


def stack_config(settings: ServeSettings) -> StackConfig:
    """The stack configuration of the server's settings (``fedmosaic serve`` and ``fedmosaic batch``)."""
    s = settings
    return StackConfig(
        model=s.model, served_model_name=s.served_model_name, model_aliases=tuple(s.model_aliases), dtype=s.dtype,
        device=s.device, run_dir=s.run_dir,
        adapters=tuple(s.adapters), adapter_root=s.adapter_root,
        target_modules=parse_targets(s.target_modules) if s.target_modules else None,
        max_loras=s.max_loras, engine=s.engine_config(), feddpa=s.feddpa_options(), default_alpha=s.default_alpha,
        check_base=s.check_base)


@dataclass(frozen=True)
class Job:
    """One generation to run through the stack.

    Attributes:
        target: a served target name (see the module docstring).
        sampling: decoding parameters.
        prompt: templated prompt text, or give ``prompt_ids``.
        prompt_ids: prompt token ids (win over ``prompt``).
        mixture: an explicit ``(adapter, weight)`` mixture overriding the target's weights.
        exact_prefill: routed targets prefill a second time with the routed weights, so the prompt's KV cache
            and the first token use the mixture as in paper 000 section 4.3 (default; about one extra prefill,
            ``bench/serving/routing.py``). False keeps the global-only prefill (faster first token, but the
            first token then comes from the global adapter and can derail a short answer).
        key: the caller's identity for this job (returned untouched with its outcome).
        cache_scope: the caller's tenant: of other tenants' prompts its prompts reuse the template only.
        shared_prefix: the leading text of ``prompt`` that is the server's chat template (""; none).
    """

    target: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    mixture: tuple[tuple[str, float], ...] | None = None
    exact_prefill: bool = True
    key: Any = None
    cache_scope: str = ""
    shared_prefix: str = ""


@dataclass(frozen=True)
class Submitted:
    """A request in the engine and the plan it was served with."""

    handle: RequestHandle
    plan: TargetPlan


@dataclass(frozen=True)
class JobOutcome:
    """A finished job: its result, or the error that kept it from running (resolution, validation)."""

    job: Job
    plan: TargetPlan | None
    result: GenerationResult | None
    error: Exception | None = None

    def weights(self) -> dict[str, float]:
        """The adapter weights the decode used, keyed by the plan's (pool) adapter names."""
        if self.plan is None or self.result is None or not self.plan.names:
            return {}
        if self.plan.mode == "amole":  # the client at weight 1: its experts are weighted per token inside
            return dict(zip(self.plan.names, self.plan.weights, strict=True))
        return dict(zip(self.plan.names, self.result.adapter_weights, strict=True))


def request_for(plan: TargetPlan, lease: Lease | None, job: Job, request_id: str | None = None
                ) -> GenerationRequest:
    """The engine request serving ``plan`` for ``job`` with the versions ``lease`` holds."""
    extra: dict[str, Any] = {"request_id": request_id} if request_id is not None else {}
    if lease is not None and lease.route is not None:  # an AMoLE client: its route, no plain adapters
        return GenerationRequest(prompt=job.prompt, prompt_ids=job.prompt_ids, sampling=job.sampling,
                                 route=lease.route, cache_scope=job.cache_scope, **extra)
    return GenerationRequest(
        prompt=job.prompt, prompt_ids=job.prompt_ids, sampling=job.sampling,
        adapter_names=lease.names if lease is not None else (), adapter_weights=plan.weights,
        weight_fn=plan.weight_fn, prefill_weights=plan.prefill_weights, state_pooling=plan.pooling,
        exact_prefill=job.exact_prefill and plan.weight_fn is not None, cache_scope=job.cache_scope,
        shared_prefix=job.shared_prefix if job.prompt is not None else "", **extra)


@dataclass(eq=False)
class ServingStack:
    """The loaded model, its adapters and the engine; see :func:`build_stack`."""

    config: StackConfig
    loaded: LoadedModel
    adapted: AdaptedModel
    engine: Engine
    pool: AdapterPool
    resolver: TargetResolver
    run_info: RunInfo | None = None
    routing: str = "fixed"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def base_name(self) -> str:
        return self.resolver.base_name

    def models(self) -> list[str]:
        """Every served target name."""
        return self.resolver.models()

    def plan(self, target: str, mixture: Sequence[tuple[str, float]] | None = None) -> TargetPlan:
        """Resolve ``target`` (raises ModelNotFound / InvalidRequest)."""
        return self.resolver.resolve(target, list(mixture) if mixture else None)

    def lease(self, plan: TargetPlan) -> Lease | None:
        """Lease the plan's adapter versions (None for the base model)."""
        return self.pool.acquire(plan.names) if plan.names else None

    def submit(self, job: Job, request_id: str | None = None) -> Submitted:
        """Resolve, lease and submit one job; the lease is released when the request finishes."""
        plan = self.plan(job.target, job.mixture)
        lease = self.lease(plan)
        try:
            handle = self.engine.submit(request_for(plan, lease, job, request_id))
        except Exception:
            if lease is not None:
                lease.release()
            raise
        if lease is not None:
            handle.add_done_callback(lease.release)
        return Submitted(handle, plan)

    def context(self) -> int | None:
        """The base model's context (``max_position_embeddings``), or None when its config names none."""
        value = getattr(self.loaded.model.config, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def fit_length(self, length: int) -> None:
        """Make the engine hold ``length`` positions per request (prompt plus completion), capped by the
        model's context: an engine whose ``max_model_len`` is shorter is replaced by one sized for it
        (same model, adapters and lock; a new KV cache), so a batch job allocates what it needs and
        not a worst case (8 slots x 2^20 positions of a SmolLM2 shape are 292 GiB on CUDA).

        Raises:
            RuntimeError: the engine's thread runs or it holds requests (it cannot be swapped then).
        """
        cap = self.context()
        length = max(2, min(length, cap) if cap is not None else length)
        config = self.engine.config
        if length <= config.max_model_len:
            return
        if self.engine.running or self.engine.has_work():
            raise RuntimeError("the engine cannot be resized while it runs or holds requests")
        self.engine = Engine(self.loaded, self.adapted, dataclasses.replace(config, max_model_len=length),
                             model_lock=self.engine.model_lock)

    def run(self, jobs: Iterable[Job], window: int | None = None) -> Iterator[JobOutcome]:
        """Run ``jobs`` with continuous batching; yield each outcome as soon as it finishes.

        Args:
            jobs: consumed lazily, so a long stream never sits in the queue at once.
            window: requests in flight at most (default: twice the batch size, at most ``max_waiting``).
        """
        cfg = self.engine.config
        window = max(1, min(window or 2 * cfg.max_batch_size, cfg.max_waiting))
        pending = iter(jobs)
        inflight: list[tuple[Job, Submitted]] = []
        exhausted = False
        while True:
            while not exhausted and len(inflight) < window:
                job = next(pending, None)
                if job is None:
                    exhausted = True
                    break
                try:
                    inflight.append((job, self.submit(job)))
                except Exception as exc:  # noqa: BLE001 - reported per job; the others go on
                    yield JobOutcome(job, None, None, exc)
            if not inflight:
                return
            if self.engine.running:
                inflight[0][1].handle.result()
            else:
                self.engine.step()
            still: list[tuple[Job, Submitted]] = []
            for job, sub in inflight:
                if sub.handle.done:
                    yield JobOutcome(job, sub.plan, sub.handle.result())
                else:
                    still.append((job, sub))
            inflight = still


def build_stack(config: StackConfig, router: WeightRouter | None = None, loaded: LoadedModel | None = None
                ) -> ServingStack:
    """Load the base model, inject adapters, fill the pool and resolve targets (no thread started).

    Args:
        config: what to load.
        router: a FedDPA weight router for ``<client>`` targets (default: instance-wise from the run's
            embeddings when ``config.feddpa`` asks for instance-wise weights and they exist, else the fixed weight).
        loaded: an already-loaded base model to use instead of loading ``config.model``.
    """
    loaded = loaded if loaded is not None else load_base_model(  # which checks the dtype is one of DTYPES
        config.model, dtype=cast(DType | None, config.dtype), device=config.device)
    specs = [(name, Path(path)) for name, _, path in (spec.partition("=") for spec in config.adapters)]
    # absolute paths: the pool resolves relative names against its root, so a relative run dir that is also
    # the root would be looked up inside itself
    run_dir = Path(config.run_dir).resolve() if config.run_dir is not None else None
    # the union of every served adapter's targets (and any asked for): each adapter adds only where it has weights
    served = served_targets(run_dir, [path for _, path in specs], loaded.model)
    adapted = inject(loaded.model, *served, *([config.target_modules] if config.target_modules else []))
    engine = Engine(loaded, adapted, config.engine)
    root = Path(config.adapter_root).resolve() if config.adapter_root else run_dir
    if root is None and specs:
        # adapters named on the command line: confine runtime loads to their common folder
        specs = [(name, path.resolve()) for name, path in specs]
        root = Path(os.path.commonpath([str(path) for _, path in specs]))
    pool = AdapterPool(adapted, root=root, max_loras=config.max_loras, model_lock=engine.model_lock,
                       check_base=config.check_base)
    run = pool.load_run(run_dir) if run_dir is not None else None
    for name, path in specs:
        pool.load(name, path)
    alpha = run.inference_weight if run is not None and run.inference_weight is not None else config.default_alpha
    routing = "custom" if router is not None else "fixed"
    feddpa = config.feddpa
    if router is None and run is not None and feddpa.instance and _has_embeddings(run):
        from routing.instance import InstanceWeightRouter

        router = InstanceWeightRouter.for_run(run.root, lambda_=alpha, options=feddpa,
                                              version_of=lambda client: pool.version(local_name(client)))
        routing = "instance"
        if feddpa.rule == "calibrated" and not _has_calibration(run):
            logger.warning("run %s has no FedDPA calibration: <client> targets use the paper's rule; "
                           "`fedmosaic calibrate %s` adds it", run.root, run.root)
    if run is not None and feddpa.instance and routing == "fixed" and run.global_name:
        logger.info("run %s has no embedding index: <client> targets use the fixed weight %.3f", run.root, alpha)
    resolver = TargetResolver(config.base_name, pool, router, alpha, config.model_aliases)
    info = {"alpha": alpha, "routing": routing, "feddpa_samples": feddpa.samples, "feddpa_mode": feddpa.mode}
    if routing == "instance":
        info["feddpa_weighting"] = feddpa.rule
        # only when ablated: the default's info (an evaluation's cache tag) stays as it was
        info.update({f"feddpa_{k}": getattr(feddpa, k) for k, default in (("similarity", "cosine"),
                     ("variant", "paper"), ("embedding", "last")) if getattr(feddpa, k) != default})
    return ServingStack(config, loaded, adapted, engine, pool, resolver, run, routing, info)


def _has_embeddings(run: RunInfo) -> bool:
    return any(c.embeddings_npy is not None for c in run.clients.values())


def _has_calibration(run: RunInfo) -> bool:
    from routing.calibration import CALIBRATION_FILE

    return any((Path(c.embeddings_npy).parent / CALIBRATION_FILE).is_file()
               for c in run.clients.values() if c.embeddings_npy is not None)
