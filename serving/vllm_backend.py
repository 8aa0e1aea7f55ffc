"""The optional vLLM backend (CUDA machines, ``gpu`` extra): FedDPA clients at quantised weights.

vLLM applies exactly one LoRA per request (anchors/serving.md sections 0 and 6), so FedDPA's
``(1 - a) B_g A_g + a B_l A_l`` cannot be mixed per request there. It is, exactly, one LoRA of rank
``r_g + r_l`` (:mod:`adapters.export`), so each client is served at
``levels`` quantised values of ``a`` (11 by default: 0, 0.1, ..., 1): the request's ``a`` (the run's
fixed weight, or the instance-wise weight of paper 000 section 4.3, computed by a prefill of the
prompt on the PyTorch model) rounds to the nearest level, and that (client, level) pair is one
rank-concatenated adapter, exported on first use. The base model, ``global``, ``<client>:local`` and
other loaded adapters are served as themselves. FedAMoLE runs route every token over experts, which
one LoRA per request cannot express: they are refused with a clear error.

:func:`choose_backend` implements ``--backend auto|torch|vllm``: ``auto`` takes vLLM only when it
imports and CUDA is available (logging which), an explicit ``vllm`` without them is an error naming
the missing piece. The backend is an executor for :func:`serving.batch.run_batch` (``fedmosaic batch``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters import read_adapter_config
from adapters.export import export_mixture
from serving.beam import plan_weights
from serving.engine.request import GenerationResult
from serving.engine.sampling import SamplingParams
from serving.errors import InvalidRequest, ServingError
from serving.pool import RunInfo
from serving.stack import Job, JobOutcome, ServingStack
from serving.targets import GLOBAL, LOCAL_SUFFIX, TargetPlan

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "vllm")
VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (1 aside)


class BackendUnavailable(ServingError):
    """The requested backend cannot run on this machine (missing package or GPU)."""


class BackendUnsupported(InvalidRequest):
    """The run or target cannot be served by the vLLM backend (e.g. FedAMoLE token routing)."""


def vllm_importable() -> bool:
    """True when the ``vllm`` package is installed."""
    return importlib.util.find_spec("vllm") is not None


def cuda_available() -> bool:
    """True when PyTorch sees a CUDA device."""
    import torch

    return bool(torch.cuda.is_available())


def choose_backend(requested: str, vllm_available: bool | None = None, cuda: bool | None = None) -> str:
    """Resolve ``--backend`` to ``torch`` or ``vllm``.

    Args:
        requested: ``auto``, ``torch`` or ``vllm``.
        vllm_available: whether vllm imports (None: probe).
        cuda: whether CUDA is available (None: probe).

    Raises:
        ValueError: an unknown backend name.
        BackendUnavailable: ``vllm`` asked for without the vllm package or without CUDA.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    has_vllm = vllm_importable() if vllm_available is None else vllm_available
    has_cuda = (cuda_available() if has_vllm else False) if cuda is None else cuda
    if requested == "vllm":
        if not has_vllm:
            raise BackendUnavailable("--backend vllm needs the vllm package, which is not installed "
                                     "(pip install 'fedmosaic[gpu]' on a CUDA machine), or use --backend torch")
        if not has_cuda:
            raise BackendUnavailable("--backend vllm needs a CUDA GPU, and torch.cuda.is_available() is False; "
                                     "use --backend torch")
        return "vllm"
    chosen = "vllm" if has_vllm and has_cuda else "torch"
    why = "vllm imports and CUDA is available" if chosen == "vllm" else (
        "vllm is not installed" if not has_vllm else "CUDA is not available")
    logger.info("backend auto: using %s (%s)", chosen, why)
    return chosen


def quantise(a: float, levels: int = 11) -> tuple[int, float]:
    """The nearest of ``levels`` evenly spaced weights in [0, 1]: ``(level index, level value)``.

    Raises:
        ValueError: ``levels < 2`` or a non-finite ``a``.
    """
    if levels < 2:
        raise ValueError(f"levels must be >= 2, got {levels}")
    if not math.isfinite(a):
        raise ValueError(f"the FedDPA weight must be finite, got {a!r}")
    k = int(math.floor(min(max(a, 0.0), 1.0) * (levels - 1) + 0.5))  # half rounds up, never to even
    return k, k / (levels - 1)


def refuse_amole(run: RunInfo | None) -> None:
    """Raise BackendUnsupported for a FedAMoLE run (per-token expert routing)."""
    if run is None:
        return
    if run.method.lower().replace("-", "") == "fedamole" or (run.root / "adapters" / "amole").is_dir():
        raise BackendUnsupported(
            f"{run.root} is a FedAMoLE run: it routes every token over experts, and vLLM applies one LoRA per "
            "request, so the vLLM backend cannot serve it; use --backend torch")


@dataclass(frozen=True)
class LevelAdapter:
    """One exported (client, level) adapter."""

    name: str
    path: Path
    a: float
    rank: int


class LevelExporter:
    """Writes each client's ``(1 - a, a)`` mixture at a quantised ``a`` as one PEFT adapter folder.

    Args:
        stack: the serving stack holding ``global`` and ``<client>:local``.
        root: where the folders go (``root/<client>/a<k>``).
        levels: quantisation levels of ``a`` (11: steps of 0.1).
    """

    def __init__(self, stack: ServingStack, root: Path, levels: int = 11) -> None:
        self.stack, self.root, self.levels = stack, root, levels
        self._done: dict[tuple[str, int], LevelAdapter] = {}

    def get(self, client: str, a: float) -> LevelAdapter:
        """The adapter of ``client`` at the level nearest ``a`` (exported on first use)."""
        k, value = quantise(a, self.levels)
        if (client, k) not in self._done:
            names = (GLOBAL, f"{client}{LOCAL_SUFFIX}")
            lease = self.stack.pool.acquire(names)
            try:
                g, loc = lease.names
                folder = self.root / client / f"a{k:0{len(str(self.levels - 1))}d}"
                with self.stack.engine.model_lock:
                    export_mixture(self.stack.adapted, [(g, 1.0 - value), (loc, value)], folder)
            finally:
                lease.release()
            rank = read_adapter_config(folder)[0].r
            self._done[(client, k)] = LevelAdapter(f"{client}@a={value:.2f}", folder, value, rank)
        return self._done[(client, k)]


def vllm_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for allowed in VLLM_RANKS:
        if rank <= allowed:
            return allowed
    raise BackendUnsupported(f"adapter rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_RANKS[-1]}")


def unsupported_sampling(params: SamplingParams) -> str | None:
    """The first parameter of ``params`` this backend cannot honour (log-probabilities, a grammar), or None."""
    if params.grammar is not None:
        return "response_format"
    if params.logprobs is not None:
        return "logprobs"
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    return None


class VLLMBackend:
    """An executor (``run(jobs) -> outcomes``) generating with ``vllm.LLM``; see the module docstring.

    Args:
        stack: the PyTorch serving stack (targets, adapters, and the routing prefill).
        export_dir: where (client, level) adapters are written.
        levels: quantisation levels of the FedDPA weight.
        max_loras: adapters resident on the GPU at once.
        chunk: jobs handed to vLLM per ``generate`` call.
        llm_options: extra ``vllm.LLM`` keyword arguments (``gpu_memory_utilization``, ``dtype`` ...).

    Raises:
        BackendUnsupported: the served run is a FedAMoLE run.
        BackendUnavailable: vllm is not installed.
    """

    def __init__(self, stack: ServingStack, export_dir: Path, levels: int = 11, max_loras: int = 8,
                 chunk: int = 256, **llm_options: Any) -> None:
        refuse_amole(stack.run_info)
        if not vllm_importable():
            raise BackendUnavailable("the vLLM backend needs the vllm package (pip install 'fedmosaic[gpu]')")
        import vllm

        from models import resolve_model_path

        self.stack, self.chunk, self._vllm = stack, chunk, vllm
        self.levels = LevelExporter(stack, export_dir, levels)
        ranks = [read_adapter_config(i.path)[0].r for i in stack.pool.info()]
        rank = vllm_rank(2 * max(ranks, default=8))  # a level adapter holds global + local
        self.llm = vllm.LLM(model=resolve_model_path(stack.config.model), enable_lora=True, max_lora_rank=rank,
                            max_loras=max_loras, **llm_options)
        self._ids: dict[str, int] = {}

    def _lora(self, name: str, path: Path) -> Any:
        from vllm.lora.request import LoRARequest

        key = f"{name}|{path}"
        self._ids.setdefault(key, len(self._ids) + 1)
        return LoRARequest(name, self._ids[key], str(path))

    def _prepare(self, job: Job) -> tuple[TargetPlan, Any, tuple[float, ...], dict[str, Any]]:
        plan = self.stack.plan(job.target, job.mixture)
        if plan.mode == "base":
            return plan, None, (), {}
        if plan.mode == "adapter":
            info = self.stack.pool.info(plan.names[0])[0]
            return plan, self._lora(info.name, info.path), (1.0,), {}
        if plan.mode != "feddpa":
            raise BackendUnsupported(f"target {job.target!r} is served in mode {plan.mode!r}; the vLLM backend "
                                     "serves the base model, single adapters and FedDPA clients", param="model")
        client = getattr(plan, "client", None) or plan.names[1][: -len(LOCAL_SUFFIX)]
        lease = self.stack.pool.acquire(plan.names)
        try:
            (weights, routed), = plan_weights(self.stack, plan, lease.names, [job.prompt or ""])
        finally:
            lease.release()
        level = self.levels.get(client, float(weights[1]))
        route = {**dict(routed), "a_requested": float(weights[1]), "a_level": level.a, "levels": self.levels.levels}
        return plan, self._lora(level.name, level.path), (1.0 - level.a, level.a), route

    def _sampling(self, job: Job) -> Any:
        s = job.sampling
        return self._vllm.SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                                         min_p=s.min_p,
                                         max_tokens=s.max_tokens, stop=list(s.stop), seed=s.seed,
                                         ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
                                         frequency_penalty=s.frequency_penalty,
                                         repetition_penalty=s.repetition_penalty,
                                         logit_bias=dict(s.logit_bias) or None, min_tokens=s.min_tokens,
                                         stop_token_ids=list(s.stop_token_ids) or None)

    def run(self, jobs: Iterable[Job], window: int | None = None) -> Iterator[JobOutcome]:
        """Generate ``jobs`` in chunks (vLLM batches each chunk continuously); yield each outcome."""
        batch: list[Job] = []
        for job in jobs:
            batch.append(job)
            if len(batch) >= (window or self.chunk):
                yield from self._generate(batch)
                batch = []
        if batch:
            yield from self._generate(batch)

    def _generate(self, jobs: list[Job]) -> Iterator[JobOutcome]:
        ready: list[tuple[Job, TargetPlan, Any, tuple[float, ...], dict[str, Any]]] = []
        for job in jobs:
            if job.prompt is None:
                yield JobOutcome(job, None, None, InvalidRequest("the vLLM backend takes text prompts", param="prompt"))
                continue
            refused = unsupported_sampling(job.sampling)
            if refused is not None:
                yield JobOutcome(job, None, None, InvalidRequest(
                    f"the vLLM batch backend does not return {refused}; use --backend torch", param=refused))
                continue
            try:
                ready.append((job, *self._prepare(job)))
            except Exception as exc:  # reported per job
                yield JobOutcome(job, None, None, exc)
        if not ready:
            return
        outputs = self.llm.generate([r[0].prompt for r in ready], [self._sampling(r[0]) for r in ready],
                                    lora_request=[r[2] for r in ready], use_tqdm=False)
        for (job, plan, _, weights, info), out in zip(ready, outputs, strict=True):
            o = out.outputs[0]
            result = GenerationResult(
                request_id=str(out.request_id), text=o.text, token_ids=tuple(o.token_ids),
                finish_reason="length" if o.finish_reason == "length" else "stop",
                prompt_tokens=len(out.prompt_token_ids or ()), completion_tokens=len(o.token_ids),
                adapter_names=plan.names, adapter_weights=weights, route_info=info)
            yield JobOutcome(job, plan, result)
