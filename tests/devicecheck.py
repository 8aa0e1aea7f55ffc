"""A CPU-side device check: run real code on the CPU while chosen tensors pretend to live on a GPU.

CI has no GPU, yet the device bugs a GPU reveals are simple: a tensor created without ``device=`` (so on
the CPU) meets the model's CUDA tensors, a CPU generator draws into a CUDA tensor, a CUDA tensor goes
to numpy or faiss without ``.cpu()``. :class:`ShadowDevice` is a ``TorchFunctionMode`` that finds them:

* :meth:`ShadowDevice.move` puts a module "on" the pretend device (``cuda:0`` by default): its tensors
  stay real CPU tensors, but inside the mode they report ``device == cuda:0`` and ``is_cuda``, so code
  that follows the model's device creates its tensors there too (a factory call with ``device=cuda:0``
  runs on the CPU and its result is marked);
* every torch call is checked as CUDA would check it: tensors of both kinds in one operation raise
  :class:`DeviceMismatch` (0-dim CPU tensors are allowed, as CUDA allows CPU scalars; index tensors of
  ``t[idx]`` may be on the CPU), a ``generator=`` whose device differs from the tensor it fills or
  creates raises the error CUDA raises, and ``.numpy()`` of a marked tensor raises as on CUDA;
* ``.to(cuda)`` / ``.cuda()`` mark a copy, ``.to("cpu")`` / ``.cpu()`` return an unmarked copy;
* ``torch.Generator(device="cuda:N")`` inside the mode gives a CPU generator that reports the pretend
  device (:class:`ShadowGenerator`), so code seeding per-request generators on the model's device runs.

Everything computes for real, so data-dependent code (``.item()``, ``.tolist()``, ``nonzero``, faiss,
numpy) runs and results can be compared with a plain CPU run. A marked tensor is one whose storage is
marked, so views, ``.data``, parameters wrapping a marked tensor and a module's converted parameters
follow; marked storages are kept alive for the mode's lifetime, so an address is never reused. Only
torch calls made from Python are seen (the autograd engine's own kernels are not, and need not be).

Why not ``FakeTensorMode`` with ``device="cuda"``: it catches mixing, but on a CPU-only torch build
indexing a fake CUDA tensor fails ("not linked with support for cuda devices"), so no HF forward runs,
and it cannot run data-dependent code. A model on the ``meta`` device does not catch mixing reliably
(``F.linear(cpu, meta)`` returns a CPU tensor), and neither catches a CPU generator drawing into
another device's tensor, which only fails on real CUDA.

Usage::

    with ShadowDevice() as shadow:
        shadow.move(loaded.model)
        ...  # the code under test; a wrong device raises DeviceMismatch or RuntimeError as on CUDA
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

PRETEND = torch.device("cuda", 0)
# Tensor methods that draw random numbers into ``self`` (their ``generator=`` must be on self's device).
_IN_PLACE_RANDOM = frozenset({"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
                              "log_normal_", "cauchy_"})
# Indexing a CUDA tensor accepts CPU index tensors; a CPU value only where setitem is a plain copy.
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_"})
# Bookkeeping that compares or inspects tensors without computing with them (e.g. ``Module._apply``).
_INSPECT = frozenset({"_has_compatible_shallow_copy_type", "__repr__", "__format__", "__hash__", "data_ptr",
                      "untyped_storage", "storage", "is_same_size"})


def _advanced(index: object) -> bool:
    """Whether ``t[index]`` is advanced indexing (a tensor or list in it), i.e. ``index_put`` for a setitem."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dim() > 0) for p in parts)


_BASE_GENERATOR = torch.Generator


class ShadowGenerator(_BASE_GENERATOR):
    """A real CPU generator that reports a pretend CUDA device (what ``torch.Generator("cuda")`` is in the mode)."""

    shadow: torch.device | None = None

    @property  # type: ignore[misc]
    def device(self) -> torch.device:  # type: ignore[override]
        return self.shadow if self.shadow is not None else _BASE_GENERATOR.device.__get__(self)  # type: ignore[attr-defined]


def _generator_factory(pretend: torch.device) -> type:
    """A ``torch.Generator`` stand-in: a pretend-device request gives a :class:`ShadowGenerator`."""

    class Generator(ShadowGenerator):
        def __new__(cls, device: object = "cpu") -> torch.Generator:  # type: ignore[misc]
            target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)  # type: ignore[arg-type]
            if target.type != pretend.type:
                return _BASE_GENERATOR(target)
            generator = ShadowGenerator.__new__(ShadowGenerator, "cpu")
            generator.shadow = pretend
            return generator

    return Generator


class DeviceMismatch(RuntimeError):
    """Tensors of the pretend GPU and of the CPU met in one operation (CUDA raises here too)."""


class ShadowDevice(TorchFunctionMode):
    """Pretend-GPU mode: see the module docstring.

    Args:
        device: the device marked tensors report (a CUDA device; nothing is ever allocated there).
    """

    def __init__(self, device: torch.device | str = PRETEND) -> None:
        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"ShadowDevice pretends a CUDA device with an index (cuda:N), got {self.device}")
        self._marked: dict[int, torch.UntypedStorage] = {}  # storage id -> the storage (kept alive)
        self.calls = 0  # torch calls seen: a test can assert the code ran inside the mode at all

    # --- marking -------------------------------------------------------------------------------

    @staticmethod
    def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no plain storage
            return None

    def on_device(self, t: torch.Tensor) -> bool:
        """True when ``t`` is (a view of) a tensor on the pretend device."""
        storage = self._storage(t)
        return storage is not None and storage._cdata in self._marked

    def _mark(self, tree: Any) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                storage = self._storage(leaf)
                if storage is not None:
                    self._marked[storage._cdata] = storage

    def move(self, module: torch.nn.Module) -> torch.nn.Module:
        """Put ``module``'s parameters and buffers on the pretend device (in place) and return it."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                self._mark(tensor)
        return module

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` on the pretend device (what ``t.to("cuda")`` gives on a GPU)."""
        copy = t.detach().clone().requires_grad_(t.requires_grad)
        self._mark(copy)
        return copy

    # --- the checks ----------------------------------------------------------------------------

    def _mismatch(self, name: str, detail: str) -> DeviceMismatch:
        return DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two devices, "
                              f"{self.device} and cpu! ({name}: {detail}; fedmosaic's device check: create "
                              "tensors with device= the model's device, or move them there)")

    def _devices(self, name: str, tensors: list[torch.Tensor], exempt: set[int]) -> bool | None:
        """Whether the operation runs on the pretend device (None: no tensor says); raise on a mix.

        ``exempt`` holds the ``id`` of tensors CUDA moves itself (CPU indices of a CUDA tensor).
        """
        on_gpu = [i for i, t in enumerate(tensors) if self.on_device(t)]
        on_cpu = [i for i, t in enumerate(tensors)
                  if i not in on_gpu and id(t) not in exempt and t.dim() > 0]
        if on_gpu and on_cpu:
            shapes = f"{tuple(tensors[on_gpu[0]].shape)} on {self.device}, {tuple(tensors[on_cpu[0]].shape)} on cpu"
            raise self._mismatch(name, shapes)
        if on_gpu:
            return True
        return False if any(t.dim() > 0 for t in tensors) else None

    def __enter__(self) -> ShadowDevice:
        self._real_generator = torch.Generator
        torch.Generator = _generator_factory(self.device)  # type: ignore[misc]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        torch.Generator = self._real_generator  # type: ignore[misc]
        super().__exit__(*exc)

    def _check_generator(self, name: str, generator: object, on_gpu: bool) -> None:
        if not isinstance(generator, _BASE_GENERATOR):
            return
        wanted = self.device.type if on_gpu else "cpu"
        if generator.device.type != wanted:
            # The message CUDA gives (e.g. torch.nn.init with a CPU generator on a CUDA parameter).
            raise RuntimeError(f"Expected a '{wanted}' device type for generator but found "
                               f"'{generator.device.type}' ({name}; fedmosaic's device check)")

    def _target(self, device: object) -> torch.device | None:
        if device is None:
            return None
        if isinstance(device, int):
            return torch.device("cuda", device)
        return torch.device(device)  # type: ignore[arg-type]

    # --- dispatch ------------------------------------------------------------------------------

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        self.calls += 1
        name = getattr(func, "__name__", str(func))
        if name == "__get__":
            return self._property(func, args)
        if name == "__set__":  # e.g. ``param.data = moved`` in Module._apply: the storage carries the mark
            return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self._move(func, args, kwargs)
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and self.on_device(args[0]):
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy "
                            "the tensor to host memory first. (fedmosaic's device check)")
        if func is torch.Tensor.get_device:
            return self.device.index if self.on_device(args[0]) else -1
        if func is torch.Tensor.copy_ or name in _INSPECT:  # copy_ crosses devices on a GPU too
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        exempt: set[int] = set()
        if name in _INDEXING and len(args) > 1 and isinstance(args[0], torch.Tensor) and self.on_device(args[0]):
            exempt = {id(t) for t in pytree.tree_leaves(args[1]) if isinstance(t, torch.Tensor)}  # the indices
            if name == "__setitem__" and len(args) > 2 and not _advanced(args[1]):
                exempt.add(id(args[2]))  # ``t[0, 1:3] = cpu_values`` is a copy_, which crosses devices
        on_gpu = self._devices(name, tensors, exempt)
        target = self._target(kwargs.get("device"))
        if target is not None and target.type == self.device.type:
            kwargs["device"] = "cpu"
        generator = kwargs.get("generator")
        if generator is not None:
            creates_on_gpu = target is not None and target.type == self.device.type
            fills = name in _IN_PLACE_RANDOM or target is None
            self._check_generator(name, generator, creates_on_gpu or (fills and bool(on_gpu)))
        out = func(*args, **kwargs)
        if target is not None:
            if target.type == self.device.type:
                self._mark(out)
        elif on_gpu:
            self._mark(out)
        return out

    def _property(self, func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        owner = args[0] if args else None
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if isinstance(owner, torch.Tensor):
            if prop == "device":
                return self.device if self.on_device(owner) else func(*args)
            if prop == "is_cuda":
                return self.on_device(owner)
            if prop == "is_cpu":
                return not self.on_device(owner)
        out = func(*args)
        if prop == "grad" and isinstance(owner, torch.Tensor) and isinstance(out, torch.Tensor) \
                and self.on_device(owner):
            self._mark(out)  # autograd made it in C++, on the parameter's device
        return out

    def _move(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``.to``/``.cpu``/``.cuda``: the copy lands on the target device (a new storage when it changes)."""
        src = args[0]
        rest = list(args[1:])
        if func is torch.Tensor.cpu:
            target: torch.device | None = torch.device("cpu")
        elif func is torch.Tensor.cuda:
            target, rest, kwargs = self.device, [], {k: v for k, v in kwargs.items() if k == "non_blocking"}
            func = torch.Tensor.to
        else:
            target = None
            for i, arg in enumerate(rest):
                if isinstance(arg, torch.Tensor):
                    target = self.device if self.on_device(arg) else arg.device
                    rest[i] = arg.dtype  # the other tensor's dtype; its device is handled here
                elif isinstance(arg, (str, int, torch.device)) and not isinstance(arg, bool):
                    target = self._target(arg)
                    rest[i] = torch.device("cpu") if target is not None and target.type == "cuda" else arg
            if kwargs.get("device") is not None:
                target = self._target(kwargs["device"])
                if target is not None and target.type == "cuda":
                    kwargs["device"] = "cpu"
        if target is not None and target.type == "cuda" and target != self.device:
            raise self._mismatch("to", f"{target} is not the pretend device {self.device}")
        out = func(src, *rest, **kwargs)
        if target is None:  # a dtype change only: same device as the source
            if self.on_device(src):
                self._mark(out)
            return out
        if target.type == "cuda":
            if not self.on_device(src) and self._storage(out) is not None and \
                    self._storage(out)._cdata == self._storage(src)._cdata:  # type: ignore[union-attr]
                out = out.clone()  # a GPU copy never shares memory with its CPU source
            self._mark(out)
        elif self.on_device(out):
            out = out.clone()  # the CPU copy of a GPU tensor is a new tensor
        return out
