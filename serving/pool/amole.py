"""FedAMoLE in the adapter pool: finding an AMoLE folder, loading and dropping its bundle, the registry.

A run's ``adapters/amole`` folder (:mod:`adapters.amole_io`; paper 002 section 4.2) holds every
expert, the token projections and each client's final assignment; there is no global adapter. A
FedAMoLE-A folder (``router: vanilla``, paper 002 s5.5) holds vanilla MoLE routers instead of token
projections, and its bundle routes with them. :func:`load_bundle` adds one version of such a folder
to the model as an :class:`~serving.engine.amole.AMoLEBundle`; the pool's :class:`AMoLERegistry`
holds the versions resident in the model and hands out one client's route per lease.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from adapters import AdaptedModel, AdapterError
from adapters.amole_io import ASSIGNMENTS, CONFIG, read_amole
from adapters.amole_routing import AMoLEExperts
from adapters.rundir import check_client_id
from serving.engine.amole import AMoLEBundle, AMoLEClientRoute


def amole_folder(path: Path) -> Path | None:
    """Return the AMoLE folder of ``path`` (an ``adapters/amole`` folder or a run directory), or None."""
    for folder in (path, path / "adapters" / "amole"):
        if (folder / CONFIG).is_file():
            return folder
    return None


def client_names(folder: Path) -> tuple[str, ...]:
    """The clients of an AMoLE folder's assignments, in file order (each a plain name)."""
    try:
        raw = json.loads((folder / ASSIGNMENTS).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{folder}: unreadable {ASSIGNMENTS} ({exc})") from exc
    if not isinstance(raw, dict) or not raw:
        raise AdapterError(f"{folder / ASSIGNMENTS} must map at least one client to its experts")
    return tuple(check_client_id(str(c)) for c in raw)


def load_bundle(adapted: AdaptedModel, folder: Path, name: str, internal: str, check_base: bool = True) -> AMoLEBundle:
    """Add the experts of the AMoLE ``folder`` to ``adapted`` under ``<internal>/`` and return the bundle.

    Raises:
        AdapterError: the folder is incomplete, targets layers this model lacks, was trained on
            another base model (with ``check_base``), or names unknown experts or layers.
    """
    data = read_amole(adapted, folder)
    ours = adapted.base_model_name
    if check_base and data.base_model and ours and data.base_model != ours:
        raise AdapterError(f"{folder} was trained on {data.base_model!r}, this server runs {ours!r}")
    prefix = f"{internal}/"
    added: list[str] = []
    try:
        for short in data.names:
            adapted.add_adapter(prefix + short, data.config)
            added.append(prefix + short)
            adapted.load_adapter_state(prefix + short, data.expert_state(short))
        proj = {}  # layer path -> P (r, d), fp32 on the layer's device
        for path in data.layers:
            layer = adapted.layers[path]
            P = data.token_proj(path, layer.in_features)
            proj[path] = P.to(device=layer.base_layer.weight.device, dtype=torch.float32)
    except Exception:
        for n in added:
            adapted.delete_adapter(n)
        raise
    experts = AMoLEExperts(prefix=prefix, token_proj=proj, top_k=data.top_k, shared=data.shared, router=data.router)
    return AMoLEBundle(name=name, internal=internal, path=folder, num_experts=data.num_experts, experts=experts,
                       layers=data.layers, assignments=data.assignments)


def unload_bundle(adapted: AdaptedModel, bundle: AMoLEBundle) -> None:
    """Remove the bundle's experts from the model."""
    for name in bundle.adapter_names:
        if name in adapted.configs:
            adapted.delete_adapter(name)


class AMoLERegistry:
    """The AMoLE bundles resident in one model, by internal name (the adapter pool owns it)."""

    def __init__(self) -> None:
        self._bundles: dict[str, AMoLEBundle] = {}
        self._lock = threading.Lock()

    def add(self, bundle: AMoLEBundle) -> None:
        with self._lock:
            self._bundles[bundle.internal] = bundle

    def remove(self, internal: str) -> AMoLEBundle | None:
        with self._lock:
            return self._bundles.pop(internal, None)

    def get(self, internal: str) -> AMoLEBundle | None:
        return self._bundles.get(internal)

    def route(self, internal: str, client: str) -> AMoLEClientRoute:
        """The route of ``client`` in bundle ``internal`` (only that client's assignment).

        Raises:
            AdapterError: no such loaded bundle or client.
        """
        bundle = self._bundles.get(internal)
        if bundle is None or client not in bundle.assignments:
            raise AdapterError(f"no AMoLE client {client!r} in the loaded version {internal!r}")
        return AMoLEClientRoute(bundle, client, bundle.assignments[client])
