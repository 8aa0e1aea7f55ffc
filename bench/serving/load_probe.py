"""``bench.serving.load``'s version probes: the hot adapter's versions, their reference answers, the reload log.

A probe request to the runtime adapter ``hot`` is decoded greedily while ``hot`` is reloaded with
version A or B every few seconds; its text must be the reference answer of a version that could
have been current while the request was leased (:class:`Timeline`). That check only means
something when each version's greedy answer does not depend on the batch it is decoded in: bf16
matmuls are not batch-invariant (the blocking, and so the rounding, follows the number of rows), and
a version whose answer sits on near-ties would then read as a wrong version under load.
:func:`references` therefore takes each candidate's answer in every batch shape the load produces
(alone, beside a few requests, beside a crowd the size of the load, and arriving while the crowd
decodes: a mixed step) and keeps only candidates that answer the same in all of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from adapters import LoraConfig, inject
from bench.serving.common import random_adapter
from models import LoadedModel

HOT = "hot"  # a runtime adapter (a run's own names reload only from the run's folders, #15)
Company = list[tuple[str, str]]  # (target, question) of requests decoded beside a probe


@dataclass
class Reply:
    """One streamed request: times relative to the run's start, the text, and what went wrong."""

    target: str
    sent: float
    headers: float | None = None
    first: float | None = None
    end: float | None = None
    text: str = ""
    tokens: int = 0
    error: str | None = None
    probe: bool = False


@dataclass
class Reload:
    """One ``load_lora_adapter`` call: which version's folder, when sent and answered, and its status."""

    label: str
    sent: float
    done: float
    ok: bool
    message: str = ""


@dataclass
class Timeline:
    """The reload log of the hot adapter, starting from ``initial`` (the label loaded before the run)."""

    initial: str
    reloads: list[Reload] = field(default_factory=list)

    def allowed(self, start: float, end: float) -> set[str]:
        """Labels that may have been current at some moment of ``[start, end]``.

        Reloads run one after another. A reload becomes current at some unknown moment between its
        send and its answer, so a window overlapping a reload allows both the old and the new label;
        a failed reload changes nothing.
        """
        ok = [r for r in self.reloads if r.ok]
        done_before = [r for r in ok if r.done <= start]
        labels = {done_before[-1].label if done_before else self.initial}
        labels.update(r.label for r in ok if r.sent <= end and r.done > start)
        return labels

async def stream(client: httpx.AsyncClient, t0: float, target: str, text: str, max_tokens: int,
                 probe: bool = False) -> Reply:
    """Send one streaming chat request and read it to the end."""
    body = {"model": target, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    reply = Reply(target, time.perf_counter() - t0, probe=probe)
    parts: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            reply.headers = time.perf_counter() - t0
            if response.status_code != 200:
                reply.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    reply.error = f"in-band error: {event['error']}"
                    continue
                if event.get("usage"):
                    reply.tokens = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        if reply.first is None:
                            reply.first = time.perf_counter() - t0
                        parts.append(piece)
    except httpx.HTTPError as exc:
        reply.error = f"{type(exc).__name__}: {exc}"
    reply.end = time.perf_counter() - t0
    reply.text = "".join(parts)
    if reply.error is None and reply.first is None and reply.tokens:
        reply.error = "no content delta before the end"
    return reply


async def reload(client: httpx.AsyncClient, t0: float, label: str, folder: Path) -> Reload:
    """Reload the hot adapter from ``folder`` as a new version (vLLM's ``load_inplace``)."""
    sent = time.perf_counter() - t0
    try:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": HOT, "lora_path": str(folder),
                                                             "load_inplace": True})
        ok, message = r.status_code == 200, r.text[:200]
    except httpx.HTTPError as exc:
        ok, message = False, f"{type(exc).__name__}: {exc}"
    return Reload(label, sent, time.perf_counter() - t0, ok, message)


async def answers(client: httpx.AsyncClient, t0: float, probe: str, tokens: int, company: Company,
                  crowd: Company) -> list[str]:
    """The probe's greedy answer in each batch shape of the load: alone, beside ``company`` and beside
    ``crowd`` (sent together), then sent while ``crowd`` decodes (its prefill in a mixed step)."""
    out = [(await stream(client, t0, HOT, probe, tokens)).text]
    for others in (company, crowd):
        together = await asyncio.gather(stream(client, t0, HOT, probe, tokens),
                                        *(stream(client, t0, target, text, 2 * tokens) for target, text in others))
        out.append(together[0].text)
    running = [asyncio.create_task(stream(client, t0, target, text, 2 * tokens)) for target, text in crowd]
    await asyncio.sleep(0.2)  # the crowd is admitted and decoding when the probe arrives
    out.append((await stream(client, t0, HOT, probe, tokens)).text)
    await asyncio.gather(*running)
    return out


async def references(client: httpx.AsyncClient, t0: float, probe: str, folders: dict[str, Path],
                     tokens: int, company: Company, crowd: Company) -> dict[str, str]:
    """The probe's greedy answers under version A and under the ``B*`` candidate chosen as version B.

    Loads A, every ``B*`` candidate, then A again (which must answer as before). A version counts only
    when its answer is the same in every batch shape (:func:`answers`). Among the candidates that
    answer the same everywhere and differently from A, the one sharing the shortest prefix with A's
    answer becomes ``folders["B"]`` (the earlier two versions part, the more of a mixed or stale decode
    shows). Leaves A loaded.

    Raises:
        RuntimeError: A's answer depends on the batch, or no candidate can be told apart from A.
    """
    async def answer(label: str) -> list[str]:
        if not (await reload(client, t0, label, folders[label])).ok:
            raise RuntimeError(f"loading the reference version {label} failed")
        return await answers(client, t0, probe, tokens, company, crowd)

    ref: dict[str, str] = {}
    seen = await answer("A")
    ref["A"] = seen[0]
    if len(set(seen)) > 1:
        raise RuntimeError(f"version A's probe answer changes with the batch: {sorted(set(seen))}")
    candidates = {k: await answer(k) for k in sorted(k for k in folders if k.startswith("B") and k != "B")}
    differ = {k: len(os.path.commonprefix([texts[0], ref["A"]])) for k, texts in candidates.items()
              if len(set(texts)) == 1 and texts[0] != ref["A"]}
    if differ:
        best = min(differ, key=lambda k: (differ[k], k))
        ref["B"], folders["B"] = candidates[best][0], folders[best]
    again = await answer("A")
    if "B" not in ref or set(again) != {ref["A"]}:
        raise RuntimeError(f"probe answers cannot tell the versions apart: A {ref['A']!r} then {sorted(set(again))}, "
                           f"candidates {({k: sorted(set(v)) for k, v in candidates.items()})}")
    return ref


def write_versions(loaded: LoadedModel, run: Path) -> dict[str, Path]:
    """Version A of ``hot`` (a copy of ``c0:local``) and the candidates for B, weakest first, inside ``run``
    (the server's adapter root): ``{"A": folder, "B0": folder, ...}``."""
    folders = {"A": run / "versions" / "A"}
    shutil.copytree(run / "adapters" / "clients" / "c0" / "local", folders["A"])
    adapted = inject(loaded.model)
    try:
        for i, scale in enumerate((0.05, 0.2, 1.0, 4.0)):
            folders[f"B{i}"] = run / "versions" / f"B{i}"
            random_adapter(adapted, f"b{i}", LoraConfig(r=8, alpha=16.0, dropout=0.0), 999, folders[f"B{i}"], scale)
    finally:
        adapted.remove()
    return folders
