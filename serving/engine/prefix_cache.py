"""Prompt-prefix reuse: the KV of recently prefilled prompts, kept in spare slots of the cache.

vLLM's automatic prefix caching, kept small: a prompt pass that ends (its whole prompt written under
one row's adapter weights) is copied into a spare slot of :class:`SlotKV` (a free one, else the least
recently used of those never reused, else the least recently used), unless a spare already holds it.
A later pass with the same adapters at the same weights copies the longest prefix it shares with a
spare into its own slot and prefills from there, always leaving its last token to compute (its
logits are the pass's output). A prompt sharing a prefix with a spare under the same key replaces it
(it holds that prefix too), so prompts that differ after a shared system prompt take one spare
between them and leave the others to other keys. Chat prompts share their template and system
prompt, so requests for one target (an adapter, a fixed mixture, the base) share them, and so do the
FedDPA routing passes (paper 000 section 4.3) of every client's requests: each runs the global
adapter alone, like a request for ``global`` (``Lifecycle._reuse_prefix`` says which passes take part).
A pass at weights routed for its own prompt (a FedDPA exact pass) matches only that prompt again, so it
never pushes out another key's spare: it takes a free spare or one held by another such pass, and such
spares go first. (A burst of eight clients' exact passes would otherwise push out the global adapter's
system prompt before any routing pass reused it, burst after burst.)

Every entry belongs to the scope of the request that left it (the caller's tenant,
:attr:`serving.access.Principal.tenant`; one scope on a server without keys). A prompt reuses all it
shares with an entry of its own scope, but of another scope's entry only the *public* prefix: the
leading tokens of the server's chat template, before the first message's content, that both prompts
have (``GenerationRequest.shared_prefix``; none for raw completions). So how much of a prompt is reused
(what ``/metrics`` counts, and what makes a prompt pass faster) says nothing about another tenant's
text, while every tenant's FedDPA routing passes and ``global`` requests still share the template and
default system prompt under ``global``. Only same-scope prompts replace one another; the slots are
shared, so a tenant's prompt may evict another's (that tells activity, never text).

Keys are the engine-internal adapter names (``<name>@<version>``, so a reloaded adapter never
matches), the weights, and the identity of each adapter's tensors (an adapter changed in place does
not match either), leaving out adapters at weight 0: they contribute nothing to any layer's output. The
KV of a prefix depends only on those and the tokens: reusing it is the pass itself, up to the
floating-point rounding of a different batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.engine.kv import SlotKV
from serving.engine.runner.inputs import RowAdapters

Key = tuple[object, ...]


@dataclass
class _Entry:
    key: Key
    tokens: tuple[int, ...]
    used: int
    hits: int = 0  # reuses of this spare's prefix (kept when a prompt sharing it replaces the prompt)
    own: bool = False  # weights routed for this prompt: only the same prompt can match it
    scope: str = ""  # the tenant whose prompt this is
    public: int = 0  # its leading tokens of server template text: other scopes may reuse that much


class PrefixCache:
    """Prompt KV kept in the spare slots of ``kv`` (none: every lookup misses).

    Args:
        kv: the engine's cache, with ``spare`` slots.
        fingerprint: the identity of an adapter's tensors by internal name (changes when they change).
    """

    def __init__(self, kv: SlotKV, fingerprint: Callable[[str], object]) -> None:
        self.kv, self.fingerprint = kv, fingerprint
        self._entries: dict[int, _Entry] = {}
        self._tick = 0
        self.hits = 0
        self.reused_tokens = 0

    def key(self, adapters: RowAdapters) -> Key | None:
        """The cache key of a pass with ``adapters``; None for an AMoLE row (routed per token)."""
        if not adapters.plain:
            return None
        # (global 1, local 0) is global alone: a routing pass shares its prefix with every client's and `global`'s
        return tuple((n, w, self.fingerprint(n)) for n, w in zip(adapters.names, adapters.weights, strict=True)
                     if w != 0)

    def _longest(self, key: Key, ids: Sequence[int], scope: str, public: int | None = None) -> tuple[int, int]:
        """(spare slot, reusable length) of the entry sharing the longest prefix with ``ids``; (-1, 0) if none.

        ``public`` None: entries of ``scope`` only; else another scope's entry counts for at most the
        public prefix of both prompts.
        """
        best = (-1, 0)
        for slot, entry in self._entries.items():
            if entry.key != key or (public is None and entry.scope != scope):
                continue
            n = 0
            for a, b in zip(entry.tokens, ids, strict=False):
                if a != b:
                    break
                n += 1
            if entry.scope != scope:
                n = min(n, public or 0, entry.public)
            if n > best[1]:
                best = (slot, n)
        return best

    def reuse(self, adapters: RowAdapters, ids: Sequence[int], slot: int, scope: str = "", public: int = 0) -> int:
        """Copy the longest cached prefix of ``ids`` under ``adapters`` into ``slot``; returns its length.

        At most ``len(ids) - 1`` positions: the last prompt token is always computed. A prefix another
        ``scope`` (tenant) left counts for its ``public`` leading tokens (the server's template) only.
        """
        key = self.key(adapters)
        if key is None or not self._entries:
            return 0
        spare, n = self._longest(key, ids, scope, public)
        n = min(n, len(ids) - 1)
        if n <= 0:
            return 0
        self._copy(spare, slot, n)
        self._tick += 1
        self._entries[spare].used = self._tick
        self._entries[spare].hits += 1
        self.hits += 1
        self.reused_tokens += n
        return n

    def remember(self, adapters: RowAdapters, ids: Sequence[int], slot: int, own: bool = False,
                 scope: str = "", public: int = 0) -> None:
        """Keep the prompt ``ids`` that ``slot`` holds under ``adapters`` (unless a spare already does).

        Args:
            own: the weights were routed for this prompt (an exact pass): keep it only in a free spare
                or in place of another such prompt, never evicting a prefix other prompts may share.
            scope: the tenant whose later prompts may reuse all of it (it replaces only that tenant's).
            public: its leading tokens of server template text, which other tenants may reuse.
        """
        key = self.key(adapters)
        if key is None or not self.kv.spare_slots:
            return
        spare, shared = self._longest(key, ids, scope)
        if shared >= len(ids):
            return
        hits = 0
        if shared == 0:  # a new prefix: a free spare, else the least recently used: own, then never-reused first
            free = [s for s in self.kv.spare_slots if s not in self._entries]
            held = [s for s in self._entries if self._entries[s].own or not own]
            if not free and not held:
                return
            spare = free[0] if free else min(held, key=lambda s: (not self._entries[s].own,
                                                                  self._entries[s].hits > 0, self._entries[s].used))
        else:  # the entry sharing the longest prefix under this key: the new prompt holds that prefix too, so
            hits = self._entries[spare].hits  # prompts after one system prompt keep one spare, not all of them
        self._copy(slot, spare, len(ids))
        self._tick += 1
        self._entries[spare] = _Entry(key, tuple(ids), self._tick, hits, own, scope, public)

    def clear(self) -> None:
        """Forget every entry (the cache was reset)."""
        self._entries.clear()

    def _copy(self, src: int, dst: int, n: int) -> None:  # n: positions src already holds
        for buffers in (self.kv.k, self.kv.v):
            for layer in buffers:
                layer[dst, :, :n] = layer[src, :, :n]
