"""Injection of MultiLoraLinear into an HF causal LM, adapter bookkeeping, and exact removal.

:func:`inject` swaps every target ``nn.Linear`` (``q_proj``/``v_proj`` by default, as the FedDPA and
FedAMoLE papers; the union of any number of target specs, :mod:`adapters.targets`) for a
:class:`~adapters.layer.MultiLoraLinear` sharing one
:class:`~adapters.context.AdapterContext`, and returns an :class:`AdaptedModel` handle holding the
name -> layer map. :meth:`AdaptedModel.remove` puts the original Linear objects back, so the model
is bit-for-bit what it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from adapters.config import AdapterError, LoraConfig, Targets, check_targets
from adapters.context import AdapterContext
from adapters.device import module_device
from adapters.layer import MultiLoraLinear
from adapters.targets import describe, select


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, child = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), child


@dataclass
class AdaptedModel:
    """A model whose target Linear layers accept named adapters and context-given weights.

    Attributes:
        model: the wrapped HF model (modified in place).
        context: the weights holder read by every adapted layer.
        layers: module path -> adapted layer, in model order.
        configs: adapter name -> its LoRA config.
    """

    model: nn.Module
    context: AdapterContext
    layers: dict[str, MultiLoraLinear]
    configs: dict[str, LoraConfig] = field(default_factory=dict)

    @property
    def adapter_names(self) -> list[str]:
        """Names of the adapters present, in insertion order."""
        return list(self.configs)

    @property
    def device(self) -> torch.device:
        """Where the wrapped model lives: inputs and adapter weights are created there."""
        return module_device(self.model)

    @property
    def base_model_name(self) -> str:
        """The base model's ``name_or_path`` (recorded in saved adapter configs)."""
        config = getattr(self.model, "config", None)
        return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")

    def target_layers(self, config: LoraConfig) -> dict[str, MultiLoraLinear]:
        """Return the adapted layers ``config.target_modules`` targets (PEFT's rules, :mod:`adapters.targets`).

        Raises:
            AdapterError: the targets match no Linear, or some Linear they match is not injected (named).
        """
        wanted = select(self.model, [config.target_modules])
        missing = [p for p in wanted if p not in self.layers]
        if missing:
            injected = sorted({p.rpartition(".")[2] for p in self.layers})
            absent = sorted({p.rpartition(".")[2] for p in missing})
            raise AdapterError(
                f"adapter targets {describe(config.target_modules)!r} include {absent} ({len(missing)} layers, "
                f"e.g. {missing[0]}), which are not injected in this model (injected: {injected}); load it into a "
                "model injected with those target modules (fedmosaic serve --target-modules all-linear covers "
                "every Linear but the output layer)"
            )
        return {p: self.layers[p] for p in wanted}

    def targets_of(self, name: str) -> frozenset[str]:
        """The module paths where adapter ``name`` has weights."""
        return frozenset(path for path, _ in self.adapter_layers(name))

    def add_adapter(self, name: str, config: LoraConfig, seed: int | None = None) -> None:
        """Add adapter ``name`` to every target layer with PEFT's init (zero update).

        Args:
            name: a new adapter name (not ``__base__``).
            config: its LoRA config; its targets must be injected.
            seed: seed for the Kaiming init of A (deterministic runs); None uses torch's RNG. The
                seeded draw is made on the CPU and copied to the model's device, so a seed gives the
                same adapter on every device.
        """
        if not name or name == "__base__" or "." in name:
            raise AdapterError(f"invalid adapter name {name!r} (non-empty, no dots, not '__base__')")
        if name in self.configs:
            raise AdapterError(f"adapter {name!r} already exists; delete it first")
        generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        for layer in self.target_layers(config).values():
            layer.add_adapter(name, config, generator)
        self.configs[name] = config

    def delete_adapter(self, name: str) -> None:
        """Remove adapter ``name`` from every layer."""
        self._require(name)
        for layer in self.layers.values():
            if name in layer.adapters:
                layer.delete_adapter(name)
        del self.configs[name]

    def _require(self, name: str) -> None:
        if name not in self.configs:
            raise AdapterError(f"unknown adapter {name!r}; present: {self.adapter_names}")

    def adapter_layers(self, name: str) -> Iterator[tuple[str, MultiLoraLinear]]:
        """Yield (module path, layer) for the layers holding adapter ``name``."""
        self._require(name)
        for path, layer in self.layers.items():
            if name in layer.adapters:
                yield path, layer

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """Return adapter ``name``'s tensors as ``{"<path>.lora_A": A, "<path>.lora_B": B}`` (detached)."""
        state: dict[str, torch.Tensor] = {}
        for path, layer in self.adapter_layers(name):
            adapter = layer.adapters[name]
            state[f"{path}.lora_A"] = adapter.lora_A.detach()
            state[f"{path}.lora_B"] = adapter.lora_B.detach()
        return state

    def load_adapter_state(self, name: str, state: Mapping[str, torch.Tensor]) -> None:
        """Copy tensors from :meth:`adapter_state`'s format into adapter ``name``, checking keys."""
        expected = set(self.adapter_state(name))
        missing, extra = expected - set(state), set(state) - expected
        if missing or extra:
            raise AdapterError(
                f"adapter {name!r}: missing keys {sorted(missing)[:4]}{'...' if len(missing) > 4 else ''}, "
                f"unexpected keys {sorted(extra)[:4]}{'...' if len(extra) > 4 else ''}"
            )
        for path, layer in self.adapter_layers(name):
            layer.set_weights(name, state[f"{path}.lora_A"], state[f"{path}.lora_B"])

    def parameters_of(self, names: Iterable[str]) -> list[nn.Parameter]:
        """Return the trainable tensors (A and B of every layer) of the given adapters."""
        params: list[nn.Parameter] = []
        for name in names:
            for _, layer in self.adapter_layers(name):
                adapter = layer.adapters[name]
                params.extend([adapter.lora_A, adapter.lora_B])
        return params

    def set_trainable(self, names: Iterable[str]) -> None:
        """Make exactly the given adapters require gradients (the base stays frozen)."""
        wanted = set(names)
        for name in wanted:
            self._require(name)
        for layer in self.layers.values():
            for name, adapter in layer.adapters.items():
                adapter.requires_grad_(name in wanted)

    def merge(self, name: str) -> None:
        """Fold adapter ``name`` into the base weights of every layer holding it."""
        for _, layer in self.adapter_layers(name):
            layer.merge(name)

    def unmerge(self) -> None:
        """Restore every layer's exact original weights."""
        for layer in self.layers.values():
            layer.unmerge()

    def remove(self) -> nn.Module:
        """Put the original Linear modules back and return the model, exactly as before injection."""
        self.unmerge()
        for path, layer in self.layers.items():
            parent, child = _parent(self.model, path)
            setattr(parent, child, layer.base_layer)
        self.layers.clear()
        self.configs.clear()
        return self.model


def inject(model: nn.Module, *target_modules: Targets | Iterable[str]) -> AdaptedModel:
    """Wrap every ``nn.Linear`` that one of the target specs targets (their union).

    Args:
        model: an HF causal LM (or any module); modified in place.
        target_modules: target specs as PEFT's ``target_modules`` (names, a regex or ``all-linear``,
            :mod:`adapters.targets`); none: ``("q_proj", "v_proj")``.

    Raises:
        AdapterError: a spec matches no Linear, or the model is already injected.
    """
    specs = [check_targets(list(t) if not isinstance(t, str) else t) for t in target_modules] or [("q_proj", "v_proj")]
    if any(isinstance(m, MultiLoraLinear) for m in model.modules()):
        raise AdapterError("this model already has fedmosaic adapters injected; call remove() first")
    context = AdapterContext()
    layers: dict[str, MultiLoraLinear] = {}
    for path in select(model, specs):
        module = model.get_submodule(path)
        assert isinstance(module, nn.Linear)  # select returns Linear paths only, and nothing is injected yet
        wrapped = MultiLoraLinear(module, context, path)
        wrapped.train(module.training)  # a new module defaults to training mode; follow the model
        parent, child = _parent(model, path)
        setattr(parent, child, wrapped)
        layers[path] = wrapped
    return AdaptedModel(model=model, context=context, layers=layers)
