"""Text the demo shows: how an answer's adapter weights were obtained, model labels, adapter rows.

FedDPA (paper 000 section 4.3) mixes a client's global and local adapters as ``(1 - a, a)`` with
``a = lambda * mean cosine`` between the prompt's representation and S of the client's local
instances, clipped to [0, 1]; the server reports ``a``, lambda, S, the similarity and the sampling
mode in ``fedmosaic.info`` (or ``source: fixed`` with the run's alpha). Calibrated weighting
reports the prompt's score (by default minus its squared Mahalanobis distance to the client's instances)
with the client's own and background levels instead. These functions turn the
``fedmosaic`` field and ``/v1/models`` entries into Markdown and table rows; they never compute a
weight themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from demos.client import ModelEntry

KIND_LABELS = {"base": "base model, no adapter", "feddpa": "FedDPA client: global + local, weighted per prompt",
               "adapter": "one adapter", "amole": "AMoLE client: experts routed per token"}


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def local_weight(extension: Mapping[str, Any] | None) -> float | None:
    """The FedDPA weight ``a`` of the local adapter, when the answer was a FedDPA mixture."""
    if not extension or extension.get("mode") != "feddpa":
        return None
    info = extension.get("info") or {}
    if isinstance(info.get("a"), int | float):
        return float(info["a"])
    weights = extension.get("weights") or {}
    local = [w for name, w in weights.items() if str(name).endswith(":local")]
    return float(local[0]) if local else None


def route_markdown(extension: Mapping[str, Any] | None) -> str:
    """Markdown explaining which adapters answered with which weights, and how they were chosen."""
    if not extension:
        return "_The server sent no `fedmosaic` routing field with this answer._"
    mode = str(extension.get("mode", "?"))
    weights: Mapping[str, Any] = extension.get("weights") or {}
    info: Mapping[str, Any] = extension.get("info") or {}
    listed = ", ".join(f"`{name}` × {_fmt(float(w))}" for name, w in weights.items()) or "none"
    lines = [f"**mode:** `{mode}` — **adapter weights:** {listed}"]
    if mode == "feddpa":
        a = local_weight(extension)
        lines.append(f"**FedDPA weight a = {_fmt(a)}** (local adapter; the global adapter gets 1 − a)"
                     if a is not None else "**FedDPA weight:** not reported")
        if info.get("source") == "fixed" or ("alpha" in info and "mean_similarity" not in info):
            alpha = f" α = {_fmt(info['alpha'])}" if "alpha" in info else ""
            lines.append(f"obtained: **fixed** — the run's inference weight{alpha} for every prompt")
        elif info.get("weighting") == "calibrated" and "score" in info:
            lines.append(f"obtained: **instance-wise, calibrated** — {info.get('statistic', '?')} score "
                         f"**{_fmt(info['score'])}** of this prompt against the client's local instances, between "
                         f"the background level {_fmt(info.get('background'))} (a = 0) and the client's own level "
                         f"{_fmt(info.get('own'))} (a = λ), λ = {_fmt(info.get('lambda'))}, clipped to [0, λ]")
        elif "mean_similarity" not in info:
            lines.append("obtained: **instance-wise** — from this prompt's similarity to the client's local "
                         "instances (the server withholds the details: admin keys see them)")
        else:
            sim, lam, s = info.get("mean_similarity"), info.get("lambda"), info.get("S")
            sampling = info.get("mode", "?")
            lines.append(f"obtained: **instance-wise** — mean cosine similarity **{_fmt(sim)}** between this prompt "
                         f"and **S = {s}** of the client's local instances (`{sampling}` sampling), "
                         f"a = λ · similarity with λ = {_fmt(lam)}, clipped to [0, 1]")
            if info.get("note"):
                lines.append(f"note: {info['note']}")
    elif mode == "base":
        lines.append("the base model alone (no adapter)")
    elif mode == "adapter":
        lines.append("one adapter at weight 1")
    elif mode == "mixture":
        lines.append("an explicit mixture from the request's `adapters` field")
    elif mode == "amole":
        found = info.get("expert_usage")
        usage = found if isinstance(found, Mapping) else {}
        k, tokens = info.get("top_k", usage.get("top_k", "k")), usage.get("tokens")
        shared = " plus the shared expert at weight 1" if info.get("shared_expert") else ""
        lines.append(f"obtained: **per token** — in every adapted layer each token goes to the top-{k} of the "
                     f"experts assigned to this client (gates renormalised){shared}"
                     + (f"; {tokens} generated tokens, see the heatmap" if tokens is not None else ""))
    extra = {k: v for k, v in info.items() if k not in ("a", "lambda", "S", "mean_similarity", "mode", "source",
                                                         "alpha", "note", "counts", "layers", "assigned",
                                                         "top_k", "shared_expert", "score", "own", "background",
                                                         "statistic")
             and not isinstance(v, Mapping | list)}
    if extra:
        lines.append("info: " + ", ".join(f"{k} = {_fmt(v)}" for k, v in extra.items()))
    return "\n\n".join(lines)


def route_summary(extension: Mapping[str, Any] | None) -> str:
    """One line per answer: the FedDPA weight and how it was obtained, or which adapters answered."""
    if not extension:
        return "no routing field"
    mode, info = str(extension.get("mode", "?")), extension.get("info") or {}
    if mode == "feddpa":
        a = local_weight(extension)
        head = f"FedDPA a = {_fmt(a)}" if a is not None else "FedDPA"
        if "mean_similarity" in info:
            return (f"{head} · instance-wise (S = {info.get('S')}, mean similarity {_fmt(info['mean_similarity'])}, "
                    f"λ = {_fmt(info.get('lambda'))})")
        if info.get("weighting") == "calibrated" and "score" in info:
            return (f"{head} · instance-wise, calibrated (score {_fmt(info['score'])}, own "
                    f"{_fmt(info.get('own'))}, background {_fmt(info.get('background'))})")
        if info.get("source") == "instance":
            return f"{head} · instance-wise"
        return f"{head} · fixed (the run's α)"
    if mode == "amole":
        found = info.get("expert_usage")
        usage = found if isinstance(found, Mapping) else {}
        k = info.get("top_k", usage.get("top_k", "k"))
        tokens = f", {usage['tokens']} tokens" if "tokens" in usage else ""
        return f"AMoLE · top-{k} of the client's experts per token{tokens}"
    weights = extension.get("weights") or {}
    listed = ", ".join(f"{name} × {_fmt(float(w))}" for name, w in weights.items())
    return f"{mode}: {listed}" if listed else mode


def model_choices(models: Sequence[ModelEntry]) -> list[tuple[str, str]]:
    """Dropdown (label, value) pairs: clients first (the personalised targets), then the rest."""
    order = {"feddpa": 0, "amole": 0, "adapter": 1, "base": 2}

    def label(m: ModelEntry) -> str:
        if m.kind in ("feddpa", "amole"):
            return f"{m.id} — client ({'global + local' if m.kind == 'feddpa' else 'AMoLE experts'})"
        if m.kind == "base":
            return f"{m.id} — base model"
        return f"{m.id} — adapter"

    ranked = sorted(enumerate(models), key=lambda im: (order.get(im[1].kind, 1), im[0]))
    return [(label(m), m.id) for _, m in ranked]


def clients(models: Sequence[ModelEntry]) -> list[str]:
    """FedDPA clients (targets that mix ``global`` and ``<client>:local``)."""
    names = {m.id for m in models}
    return [m.id for m in models if m.kind == "feddpa" and "global" in names and f"{m.id}:local" in names]


def adapter_rows(models: Sequence[ModelEntry]) -> list[list[Any]]:
    """Rows for the adapters table: id, kind, version, pinned, loaded, folder."""
    rows = []
    for m in models:
        d = m.details
        rows.append([m.id, KIND_LABELS.get(m.kind, m.kind), d.get("version", ""), d.get("pinned", ""),
                     d.get("loaded", ""), m.root if m.kind == "adapter" else ""])
    return rows


def loaded_adapters(models: Sequence[ModelEntry]) -> list[str]:
    """Names that ``/v1/unload_lora_adapter`` accepts."""
    return [m.id for m in models if m.kind == "adapter"]
