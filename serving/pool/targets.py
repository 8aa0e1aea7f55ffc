"""The Linear modules a server adapts: the union of the target modules of the adapters it starts with.

The model is injected once, before the engine starts (the fused runner lays its adapter stacks out
over the adapted projections), so the server reads, before loading any weights, the target spec of
every adapter it serves from the start: a run's LoRA config (``run.json``'s ``train.lora``, which every
adapter of the run was trained with; its global adapter's and AMoLE folder's own configs too) and each
adapter folder's ``adapter_config.json`` (or ``amole_config.json``). Each adapter then contributes only
where it has weights. An adapter loaded at runtime whose targets reach beyond that union is refused
with the modules it lacks named (:meth:`adapters.inject.AdaptedModel.target_layers`); ``--target-modules``
adds modules to the union up front (``all-linear``: every Linear but the output layer).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from torch import nn

from adapters import AdapterError
from adapters.amole_io import read_amole_meta
from adapters.config import LoraConfig, Targets, check_targets
from adapters.io import read_adapter_config
from adapters.rundir import RunDir
from adapters.targets import select
from serving.pool.amole import amole_folder


def served_targets(run_dir: Path | None, folders: Iterable[Path], model: nn.Module) -> list[Targets]:
    """The target specs of a run directory's adapters and of adapter folders that match Linear modules of
    ``model``, in order, without duplicates (none: :func:`adapters.inject.inject`'s default, q_proj/v_proj).

    A file that cannot be read, or targets that match nothing in ``model``, add nothing here: loading the
    adapter reports it, with its reason.
    """
    specs: list[Targets] = []
    if run_dir is not None:
        run = RunDir(run_dir)
        specs += [spec for spec in (_run_json_targets(run.run_json), _folder_targets(run.global_adapter),
                                    _folder_targets(run.root)) if spec is not None]
    specs += [spec for spec in map(_folder_targets, folders) if spec is not None]
    return [spec for spec in dict.fromkeys(specs) if _fits(model, spec)]


def _fits(model: nn.Module, spec: Targets) -> bool:
    try:
        return bool(select(model, [spec]))
    except AdapterError:
        return False


def _run_json_targets(path: Path) -> Targets | None:
    """``run.json``'s ``train.lora.target_modules`` (None for runs that predate it, or an unreadable file)."""
    try:
        lora = json.loads(path.read_text())["train"]["lora"]
        return check_targets(lora["target_modules"])
    except (OSError, ValueError, KeyError, TypeError, AdapterError):
        return None


def _folder_targets(folder: Path) -> Targets | None:
    """The target spec of a PEFT adapter folder or an AMoLE folder (or a run holding one); None otherwise."""
    try:
        amole = amole_folder(folder)
        if amole is not None:
            return LoraConfig.from_peft_dict(read_amole_meta(amole)["lora"]).target_modules
        if not (folder / "adapter_config.json").is_file():
            return None
        return read_adapter_config(folder)[0].target_modules
    except (OSError, ValueError, KeyError, TypeError):  # AdapterError is a ValueError
        return None
