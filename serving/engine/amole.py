"""FedAMoLE in the engine: per-client routes, a batch's token routing, expert-usage reports.

FedAMoLE (paper 002, section 4.2; docs/methods.md 1.2) routes every token of client ``c`` over the domain
experts assigned to ``c`` in each module (its token projection scores them, the top-k gates are
renormalised, the shared expert adds at weight 1). One loaded version of a FedAMoLE folder is an
:class:`AMoLEBundle`: its experts live in the adapted layers under the adapter-name prefix
``<internal>/`` (``amole@2/expert_7``), its token projections in the bundle, so two versions coexist
while requests of the old one finish. The adapter pool loads and drops bundles
(:mod:`serving.pool.amole`); a pool lease on one client hands out that client's
:class:`AMoLEClientRoute`, a request carries it as a typed field, and the engine turns the routes of
a batch into one :class:`~adapters.amole_routing.AMoLERouting` (the layers' token-routing hook) whose
rows are grouped by (version, client). A route carries only its own client's assignment: a request
never reads another client's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adapters.amole_layer import SHARED, expert_name
from adapters.amole_routing import AMoLEExperts, AMoLERouting
from adapters.amole_union import ExpertRecorder


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
    assignments: Mapping[str, Mapping[str, tuple[int, ...]]] = field(compare=False)

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
