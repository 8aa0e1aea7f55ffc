"""AMoLE expert usage of one answer: find it in the response's ``fedmosaic`` field, draw layers x experts.

FedAMoLE (AMoLE, paper 003 section 3) routes every token, in every adapted module, to the top-k of the
domain experts assigned to the client. The server reports how often each expert was selected per
layer. This module accepts the shapes such a report may take inside ``fedmosaic.info`` and returns
None when a response has none (FedDPA, single adapters), so the UI simply hides the plot:

* ``{"counts": {layer: [count per expert]}, "experts": [ids], "layers": [order], "assigned": {...}}``
  (``serving.engine.amole.usage_report``), under any key of ``info`` or as ``info`` itself;
* ``{layer: {expert_id: count}}`` (``info.experts`` or any nested mapping of that shape).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from matplotlib.figure import Figure

PREFERRED_KEYS = ("experts", "expert_usage", "amole", "usage", "routing")


@dataclass(frozen=True)
class ExpertUsage:
    """Selections per (layer, expert).

    Attributes:
        layers: adapted module paths, in model order.
        experts: expert ids (as strings).
        counts: ``(L, E)`` selections, row per layer.
        assigned: layer -> expert ids assigned to the client (marked in the plot), when reported.
        tokens: tokens the counts cover, when reported.
    """

    layers: tuple[str, ...]
    experts: tuple[str, ...]
    counts: tuple[tuple[float, ...], ...]
    assigned: Mapping[str, tuple[str, ...]] | None = None
    tokens: int | None = None


def _number(x: Any) -> TypeGuard[int | float]:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _from_report(node: Mapping[str, Any]) -> ExpertUsage | None:
    counts = node.get("counts")
    if not isinstance(counts, Mapping) or not counts:
        return None
    layers = [str(x) for x in node["layers"]] if isinstance(node.get("layers"), list) else [str(k) for k in counts]
    if set(layers) != {str(k) for k in counts}:
        layers = [str(k) for k in counts]
    rows = {str(k): v for k, v in counts.items()}
    if all(isinstance(v, list) and all(_number(x) for x in v) for v in rows.values()):
        width = max(len(v) for v in rows.values())
        ids = node.get("experts")
        if isinstance(ids, list) and len(ids) == width:
            experts = [str(e) for e in ids]
        else:
            experts = [str(j) for j in range(width)]
        matrix = [tuple(float(x) for x in rows[layer]) + (0.0,) * (width - len(rows[layer])) for layer in layers]
    else:
        parsed = _from_nested(rows)
        if parsed is None:
            return None
        experts, matrix = list(parsed.experts), [parsed.counts[parsed.layers.index(layer)] for layer in layers]
    assigned = node.get("assigned")
    marks = ({str(k): tuple(str(e) for e in v) for k, v in assigned.items() if isinstance(v, list)}
             if isinstance(assigned, Mapping) else None)
    tokens = node.get("tokens")
    return ExpertUsage(tuple(layers), tuple(experts), tuple(matrix), marks, int(tokens) if _number(tokens) else None)


def _from_nested(node: Mapping[str, Any]) -> ExpertUsage | None:
    """``{layer: {expert: count}}``."""
    if not node or not all(isinstance(v, Mapping) and v and all(_number(c) for c in v.values())
                           for v in node.values()):
        return None
    experts = sorted({str(e) for v in node.values() for e in v}, key=_natural)
    layers = [str(k) for k in node]
    matrix = [tuple(float({str(e): c for e, c in node[k].items()}.get(e, 0.0)) for e in experts) for k in node]
    return ExpertUsage(tuple(layers), tuple(experts), tuple(matrix))


def _natural(text: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def find_expert_usage(extension: Mapping[str, Any] | None, depth: int = 3) -> ExpertUsage | None:
    """Return the expert usage reported in a response's ``fedmosaic`` field, or None.

    Args:
        extension: the ``fedmosaic`` object (``{"mode", "weights", "info"}``) or its ``info``.
        depth: how deep to look inside nested mappings.
    """
    if not isinstance(extension, Mapping) or depth < 0:
        return None
    info = extension.get("info")
    node = info if isinstance(info, Mapping) else extension
    found = _from_report(node) or _from_nested(node)
    if found is not None:
        return found
    keys = [k for k in PREFERRED_KEYS if k in node] + [k for k in node if k not in PREFERRED_KEYS]
    for key in keys:
        value = node[key]
        if isinstance(value, Mapping):
            found = find_expert_usage({"info": value}, depth - 1)
            if found is not None:
                return found
    return None


def short_layer(path: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``3.q_proj`` (the layer index and the module)."""
    index = re.search(r"layers\.(\d+)\.", path)
    leaf = path.rsplit(".", 1)[-1]
    return f"{index.group(1)}.{leaf}" if index else path


def usage_figure(usage: ExpertUsage, title: str = "AMoLE expert usage") -> Figure:
    """Heatmap of selections: rows are layers, columns experts; assigned experts are outlined."""
    rows, cols = len(usage.layers), len(usage.experts)
    fig = Figure(figsize=(min(2.0 + 0.55 * cols, 12.0), min(1.6 + 0.28 * rows, 14.0)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow([list(r) for r in usage.counts], aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="top-k selections")
    ax.set_xticks(range(cols), usage.experts)
    ax.set_yticks(range(rows), [short_layer(x) for x in usage.layers], fontsize=7 if rows > 16 else 9)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    if usage.assigned:
        for i, layer in enumerate(usage.layers):
            for expert in usage.assigned.get(layer, ()):
                if expert in usage.experts:
                    j = usage.experts.index(expert)
                    ax.add_patch(_outline(j, i))
    suffix = f" ({usage.tokens} tokens)" if usage.tokens is not None else ""
    ax.set_title(title + suffix)
    return fig


def _outline(x: int, y: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="white", linewidth=1.2)


def totals(usage: ExpertUsage) -> Sequence[float]:
    """Selections per expert summed over layers (the caption's summary)."""
    return [sum(row[j] for row in usage.counts) for j in range(len(usage.experts))]
