"""Which Linear modules a LoRA adapts: PEFT's ``target_modules`` rules, names, a regex or ``all-linear``.

A target spec is what PEFT's ``LoraConfig.target_modules`` holds, with PEFT's meaning
(``peft.tuners.tuners_utils.check_target_module_exists`` and ``_maybe_include_all_linear_layers``):

* a tuple of names: a module is adapted when its path equals a name or ends in ``"." + name``
  (``q_proj`` adapts every ``...self_attn.q_proj``; PEFT 0.21 saves ``all-linear`` adapters as full
  paths such as ``model.layers.0.mlp.up_proj``, which match exactly);
* a string: a regular expression that must match the whole module path (``re.fullmatch``);
* ``all-linear``: every ``nn.Linear`` of the model except its output layer (``get_output_embeddings()``,
  the ``lm_head``), the QLoRA rule PEFT applies.

On the command line (:func:`parse_targets`) a value made of module names separated by commas is a list
of names, ``all-linear`` is that shorthand, and anything else is a regular expression.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from adapters.config import ALL_LINEAR, AdapterError, Targets, check_targets

_NAMES = re.compile(r"[A-Za-z0-9_.,]*[A-Za-z0-9_][A-Za-z0-9_.,]*")  # names and commas (empty items dropped)


def parse_targets(text: str) -> Targets:
    """A command-line ``--target-modules`` value as a target spec (see the module docstring).

    Raises:
        AdapterError: empty, or a regular expression that does not compile.
    """
    text = text.strip()
    if not text:
        raise AdapterError("--target-modules needs module names (q_proj,v_proj), all-linear or a regular expression")
    if text.lower() == ALL_LINEAR:
        return ALL_LINEAR
    if _NAMES.fullmatch(text.replace(" ", "")):
        return check_targets(tuple(n for n in text.replace(" ", "").split(",") if n))
    return check_targets(text)


def describe(spec: Targets) -> str:
    """``spec`` as one line of text (names joined by commas, a regex or ``all-linear`` as given)."""
    return spec if isinstance(spec, str) else ",".join(spec)


def matches(spec: Targets, path: str) -> bool:
    """Whether module ``path`` is a target of ``spec`` by PEFT's rule (``all-linear``: see :func:`select`)."""
    if spec == ALL_LINEAR:
        raise AdapterError("all-linear depends on the model: resolve it with adapters.targets.select")
    if isinstance(spec, str):
        return re.fullmatch(spec, path) is not None
    return any(path == t or path.endswith("." + t) for t in spec)


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear of ``model`` by path; an adapted layer counts as the Linear it wraps (its inside is skipped)."""
    from adapters.layer import MultiLoraLinear  # the layer imports the config; kept local to stay a leaf

    found: dict[str, nn.Module] = {}
    todo: list[tuple[str, nn.Module]] = [("", model)]
    while todo:  # depth first in module order, never inside an adapted layer
        path, module = todo.pop()
        if isinstance(module, MultiLoraLinear | nn.Linear):
            found[path] = module
            continue
        todo.extend(reversed([(f"{path}.{n}" if path else n, child) for n, child in module.named_children()]))
    return found


def output_layer(model: nn.Module) -> str | None:
    """The path of ``model``'s output layer (``get_output_embeddings()``), which ``all-linear`` leaves out."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((path for path, module in model.named_modules() if module is head), None)


def select(model: nn.Module, specs: Iterable[Targets]) -> list[str]:
    """The paths of ``model``'s Linear modules that any of ``specs`` targets (their union), in model order.

    Raises:
        AdapterError: a spec matches no Linear module (the message lists the model's Linear names).
    """
    linear = linear_modules(model)
    head = output_layer(model)
    chosen: set[str] = set()
    for spec in specs:
        if spec == ALL_LINEAR:
            hits = {p for p in linear if p != head}
        else:
            hits = {p for p in linear if matches(spec, p)}
        if not hits:
            names = sorted({p.rpartition(".")[2] for p in linear})
            raise AdapterError(f"target modules {describe(spec)!r} match no nn.Linear in the model; "
                               f"its Linear modules: {names}")
        chosen |= hits
    return [p for p in linear if p in chosen]
