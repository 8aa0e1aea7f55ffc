"""Host work of an engine step: its wall and CPU time, host-device synchronisations, a profiler trace.

A GPU step is fast only when the host keeps the device fed: every read of a device tensor's values on
the host (``.item()``, ``.tolist()``, ``.cpu()``, a copy into host memory, ``bool(t)``) waits for
all queued kernels, and Python between launches leaves the device idle (the server's
prefill steps took 134 ms for a few milliseconds of H100 compute). :class:`StepClock` measures a step:
wall time, the engine thread's CPU time, and with ``count_syncs`` the synchronisations and the time
spent waiting in them (a :class:`SyncCounter`, a ``TorchFunctionMode``: one Python call per torch call,
so for profiling only). :class:`StepProfiler` writes a torch profiler trace of a few engine steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand a tensor's values to the host (on a device tensor: a synchronisation).
_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__})


def _to_host(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` moves a tensor's values to host memory, waiting for them."""
    if func in _READS:
        return True
    if func is torch.Tensor.to:
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return target is not None and torch.device(target).type == "cpu" and not kwargs.get("non_blocking", False)
    if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[0].device.type == "cpu" and not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
    return False


class SyncCounter(TorchFunctionMode):
    """Counts host-device synchronisations (host reads of non-CPU tensors) and the time spent in them.

    Seen are the torch calls made from Python in the thread that entered the mode; a CPU tensor's
    reads cost nothing and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.seconds = 0.0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        source = args[1] if func is torch.Tensor.copy_ and len(args) > 1 else args[0] if args else None
        if isinstance(source, torch.Tensor) and source.device.type != "cpu" and _to_host(func, args, kwargs):
            started = time.perf_counter()
            out = func(*args, **kwargs)
            self.seconds += time.perf_counter() - started
            self.syncs += 1
            return out
        return func(*args, **kwargs)


class StepClock:
    """Times one engine step (a context manager); with ``count_syncs`` it counts its synchronisations."""

    def __init__(self, count_syncs: bool = False) -> None:
        self.counter = SyncCounter() if count_syncs else None
        self.seconds = self.cpu_seconds = 0.0

    @property
    def syncs(self) -> int:
        """Host-device synchronisations in the step (0 when not counted)."""
        return self.counter.syncs if self.counter is not None else 0

    @property
    def sync_seconds(self) -> float:
        """Seconds spent in them (waiting for the device, and the copies)."""
        return self.counter.seconds if self.counter is not None else 0.0

    def __enter__(self) -> StepClock:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = time.thread_time() - self._cpu


class StepProfiler:
    """A step observer that records engine steps with the torch profiler and writes one trace.

    Started by the first step it sees (in the engine's thread), it skips ``skip`` steps, records
    ``steps`` (CPU, and CUDA kernels where there is a GPU) and writes a Chrome / TensorBoard trace
    into ``folder`` (``torch.profiler.tensorboard_trace_handler``), then stops.

    Args:
        folder: where the trace goes (created).
        skip: steps left out first (start-up, CUDA graph capture).
        steps: steps recorded.
    """

    def __init__(self, folder: Path, skip: int = 8, steps: int = 16) -> None:
        self.folder, self.skip, self.steps = Path(folder), skip, steps
        self.folder.mkdir(parents=True, exist_ok=True)
        self._profile: torch.profiler.profile | None = None
        self._seen = 0
        self.done = False

    def __call__(self, report: object) -> None:
        if self.done:
            return
        if self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(
                activities=activities, record_shapes=True,
                schedule=torch.profiler.schedule(wait=max(self.skip - 1, 0), warmup=1, active=self.steps, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.folder), worker_name="engine"))
            self._profile.start()
        self._seen += 1
        self._profile.step()
        if self._seen >= self.skip + self.steps:
            self._profile.stop()
            self.done = True
