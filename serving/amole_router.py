"""FedAMoLE at serving time: AMoLE runs resident in the model, per-client routes, expert-usage reports.

FedAMoLE (paper 002, section 4.2; METHODS.md 1.2) routes every token of client ``c`` over the domain
experts assigned to ``c`` in each module (its token projection scores them, the top-k gates are
renormalised, the shared expert adds at weight 1). A run's ``adapters/amole`` folder
(:mod:`adapters.amole_io`) holds every expert, the token projections and each client's final
assignment; there is no global adapter. A FedAMoLE-A folder (``router: vanilla``, paper 002 s5.5) holds
vanilla MoLE routers instead of token projections, and its bundle routes with them.

Here one loaded version of such a folder is an :class:`AMoLEBundle`: its experts live in the
adapted layers under the adapter-name prefix ``<internal>/`` (``amole@2/expert_7``), its token
projections in the bundle, so two versions coexist while requests of the old one finish. The
adapter pool loads and drops bundles; a pool lease on one client hands out that client's
:class:`AMoLEClientRoute`, a request carries it as a typed field, and the engine turns the routes of
a batch into one :class:`~adapters.amole_routing.AMoLERouting` (the layers' token-routing hook) whose
rows are grouped by (version, client). A route carries only its own client's assignment: a request
never reads another client's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adapters import AdaptedModel, AdapterError
from adapters.amole_io import ASSIGNMENTS, CONFIG, read_amole
from adapters.amole_layer import SHARED, expert_name
from adapters.amole_routing import AMoLEExperts, AMoLERouting, ExpertRecorder
from adapters.rundir import check_client_id


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


@dataclass(frozen=True)
class AMoLEBundle:
    """One loaded version of an AMoLE model.

    Attributes:
        name: the pool name it was registered under.
        internal: the versioned name (``<name>@<version>``); experts are ``<internal>/expert_<j>``.
        path: the AMoLE folder it came from.
        num_experts: domain experts per module.
        experts: the adapter prefix, token projections (layer path -> P (r, d)), top_k, shared flag.
        layers: adapted layer paths holding experts, in model order.
        assignments: client -> layer path -> assigned expert ids (read per client, never whole).
    """

    name: str
    internal: str
    path: Path
    num_experts: int
    experts: AMoLEExperts
    layers: tuple[str, ...]
    assignments: dict[str, Mapping[str, tuple[int, ...]]] = field(compare=False)

    @property
    def adapter_names(self) -> list[str]:
        """The adapter names this bundle added to the model."""
        names = [self.experts.prefix + expert_name(j) for j in range(self.num_experts)]
        return names + ([self.experts.prefix + SHARED] if self.experts.shared else [])

    def clients(self) -> list[str]:
        """Clients with an assignment, in file order."""
        return list(self.assignments)


@dataclass(frozen=True)
class AMoLEClientRoute:
    """What one request decodes with: one client of one bundle version, and only its assignment."""

    bundle: AMoLEBundle
    client: str
    assignment: Mapping[str, tuple[int, ...]] = field(compare=False)

    @property
    def key(self) -> tuple[str, str]:
        """Rows with the same key share a routing group."""
        return self.bundle.internal, self.client

    def info(self) -> dict[str, Any]:
        """The routing facts a response reports (no other client's data)."""
        b = self.bundle
        version = b.internal.rpartition("@")[2]
        info = {"client": self.client, "model": b.name, "version": int(version) if version.isdigit() else version,
                "top_k": b.experts.top_k, "shared_expert": bool(b.experts.shared), "num_experts": b.num_experts}
        if b.experts.router == "vanilla":  # FedAMoLE-A (paper 002 s5.5); AMoLE's answers keep their fields
            info["router"] = "vanilla"
        return info


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


def batch_routing(routes: Sequence[AMoLEClientRoute | None],
                  recorder: ExpertRecorder | None = None) -> AMoLERouting | None:
    """One routing for a batch: rows grouped by (version, client); rows without a route get group -1.

    Returns:
        None when no row is an AMoLE row.
    """
    groups: dict[tuple[str, str], int] = {}
    chosen: list[AMoLEClientRoute] = []
    row_group = []
    for route in routes:
        if route is None:
            row_group.append(-1)
            continue
        if route.key not in groups:
            groups[route.key] = len(chosen)
            chosen.append(route)
        row_group.append(groups[route.key])
    if not chosen:
        return None
    # row groups are host-side bookkeeping (AMoLERouting keeps them on the CPU)
    return AMoLERouting(groups=tuple(r.assignment for r in chosen), row_group=torch.tensor(row_group, device="cpu"),
                        experts=tuple(r.bundle.experts for r in chosen), recorder=recorder)


def usage_report(route: AMoLEClientRoute, counts: torch.Tensor, tokens: int) -> dict[str, Any]:
    """The response's expert-usage field: per layer, top-k selections per expert id over ``tokens``.

    Args:
        route: the request's route.
        counts: (len(bundle.layers), num_experts) top-k selections of the positions that produced
            the generated tokens (the last prompt position, then every decode input).
        tokens: generated tokens counted.
    """
    b = route.bundle
    return {"tokens": tokens, "top_k": b.experts.top_k, "experts": list(range(b.num_experts)),
            "layers": list(b.layers),
            "counts": {path: counts[i].tolist() for i, path in enumerate(b.layers)},
            "assigned": {path: list(route.assignment[path]) for path in b.layers}}
