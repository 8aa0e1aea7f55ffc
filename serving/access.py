"""Who may call the server: bearer keys, their roles, and the targets a key is bound to.

HTTP-neutral (no FastAPI, no pydantic): :mod:`serving.api.dependencies` reads the ``Authorization``
header and asks a :class:`KeyRing` who the caller is.

* **Admin keys** may do everything: inference on every target, runtime adapter load/unload, the
  run's files, ``/metrics`` when it is protected, and FedDPA routing details in responses.
* **User keys** may run inference and list models. A user key can be **bound** to the targets it may
  use (a *virtual key*, as LLM gateways call it): bound to client ``sorting`` it reaches ``sorting``,
  ``sorting:local``, ``global``, ``amole:sorting`` and the base model, nothing else; bound to models,
  exactly those.
* With no key configured at all the server is open: every caller is an anonymous, unbound user.
* Every key is a **tenant** (:attr:`Principal.tenant`): caches a request can observe, the prompt-prefix
  cache, are partitioned by it, so nothing one key's requests left shows in another key's (an open
  server is one tenant).

Keys come from settings (environment or code), from key files (one key per line; blank lines and
lines starting with ``#`` skipped) and from a binding file (JSON, below). A key is looked up by its
SHA-256 digest, so the lookup time does not depend on how much of a wrong key matches a right one.

Binding file::

    {"keys": [
        {"key": "sk-sorting-...", "clients": ["sorting"], "name": "sorting"},
        {"key": "sk-eval-...", "models": ["global", "smollm2"]}
    ]}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from routing.base import GLOBAL, local_name
from serving.pool.amole_run import aggregated_target

Role = Literal["admin", "user"]


class AccessConfigError(ValueError):
    """A key file or binding file is missing or malformed (raised when the server starts)."""


@dataclass(frozen=True)
class Binding:
    """The targets a bound key may use.

    Attributes:
        clients: personalised clients; each adds ``<client>``, ``<client>:local``, ``global``, the base
            and ``amole:<client>`` (the client in a FedAMoLE run's aggregated pool).
        models: further target names, taken as they are.
    """

    clients: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()

    def allows(self, target: str, base_name: str) -> bool:
        """True when ``target`` is one of this binding's targets."""
        if target in self.models:
            return True
        if not self.clients:
            return False
        return target in (GLOBAL, base_name) or target in self.clients or any(
            target in (local_name(c), aggregated_target(c)) for c in self.clients)


@dataclass(frozen=True)
class Principal:
    """The caller of one request.

    Attributes:
        role: ``admin`` or ``user``.
        name: a label for logs (a binding's ``name``, ``admin``, ``user`` or ``anonymous``); never the key.
        binding: the targets a bound user key may use; None reaches every target.
        authenticated: False for the anonymous caller of a server without keys.
        tenant: the cache partition of this caller's requests (one per key, derived from its digest; ""
            for the anonymous caller): a request reuses only prompt prefixes its own key's requests left.
    """

    role: Role
    name: str
    binding: Binding | None = None
    authenticated: bool = True
    tenant: str = field(default="", repr=False)

    @property
    def admin(self) -> bool:
        """True for an admin key."""
        return self.role == "admin"

    def allows(self, target: str, base_name: str) -> bool:
        """True when this caller may use ``target``."""
        return self.binding is None or self.binding.allows(target, base_name)


ANONYMOUS = Principal("user", "anonymous", None, authenticated=False)


def _digest(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


@dataclass(frozen=True)
class KeyRing:
    """Every configured key, by SHA-256 digest of its UTF-8 bytes.

    Attributes:
        principals: digest -> the caller a key identifies.
    """

    principals: Mapping[str, Principal] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """True when no key is configured (everyone is an anonymous user)."""
        return not self.principals

    @property
    def has_admins(self) -> bool:
        """True when at least one admin key is configured."""
        return any(p.admin for p in self.principals.values())

    def identify(self, token: bytes | None) -> Principal | None:
        """The caller presenting ``token`` (raw header bytes); None when it matches no key.

        On an open server every caller, with or without a token, is :data:`ANONYMOUS`.
        """
        if self.open:
            return ANONYMOUS
        if not token:
            return None
        return self.principals.get(_digest(token))

    @classmethod
    def build(cls, api_keys: Iterable[str] = (), admin_keys: Iterable[str] = (),
              api_key_file: Path | None = None, admin_key_file: Path | None = None,
              binding_file: Path | None = None) -> KeyRing:
        """Collect keys from settings and files.

        Raises:
            AccessConfigError: a file is unreadable or malformed, a key is empty or has surrounding
                spaces, or one key is given two roles or two bindings.
        """
        entries: list[tuple[str, Principal]] = []
        users = [*api_keys, *(read_key_file(api_key_file) if api_key_file else [])]
        admins = [*admin_keys, *(read_key_file(admin_key_file) if admin_key_file else [])]
        entries += [(k, Principal("admin", "admin")) for k in admins]
        entries += [(k, Principal("user", "user")) for k in users]
        if binding_file is not None:
            entries += [(k, Principal("user", name, b)) for k, name, b in read_binding_file(binding_file)]
        principals: dict[str, Principal] = {}
        for key, principal in entries:
            if not key or key != key.strip():
                raise AccessConfigError("API keys must be non-empty and have no surrounding spaces")
            digest = _digest(key.encode("utf-8"))
            principal = replace(principal, tenant=digest[:32])
            if digest in principals and principals[digest] != principal:
                raise AccessConfigError(f"a key is configured twice with different roles or bindings "
                                        f"({principals[digest].name} and {principal.name})")
            principals[digest] = principal
        return cls(principals)


def read_key_file(path: Path) -> list[str]:
    """Keys of a key file: one per line; blank lines and ``#`` comments skipped.

    Raises:
        AccessConfigError: the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AccessConfigError(f"cannot read the key file {path}: {exc}") from exc
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def read_binding_file(path: Path) -> list[tuple[str, str, Binding]]:
    """(key, name, binding) of every entry of a binding file (format in the module docstring).

    Raises:
        AccessConfigError: unreadable, not the documented JSON, or an entry that binds nothing.
    """
    try:
        data: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AccessConfigError(f"cannot read the key binding file {path}: {exc}") from exc
    items = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise AccessConfigError(f"{path}: expected {{\"keys\": [{{\"key\": ..., \"clients\": [...]}}, ...]}}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("key"), str) \
                or set(item) - {"key", "clients", "models", "name"}:
            raise AccessConfigError(f"{path}: entry {i} must have a string 'key' and only 'clients', 'models', "
                                    "'name' beside it")
        clients, models = _names(item.get("clients", []), path, i), _names(item.get("models", []), path, i)
        if not clients and not models:
            raise AccessConfigError(f"{path}: entry {i} binds its key to nothing (give 'clients' or 'models')")
        name = item.get("name") or f"binding-{i}"
        out.append((item["key"], str(name), Binding(frozenset(clients), frozenset(models))))
    return out


def _names(value: Any, path: Path, i: int) -> Sequence[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise AccessConfigError(f"{path}: entry {i}: 'clients' and 'models' are lists of names")
    return value
