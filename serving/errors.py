"""Domain errors of the serving package, all deriving from :class:`ServingError`.

Each carries an HTTP-neutral meaning; ``serving/openai/errors.py`` is the one place that maps them to a
status code and the OpenAI error envelope. Python callers of the engine and the pool catch these.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of every serving error."""


class InvalidRequest(ServingError, ValueError):
    """A request's parameters are out of range or inconsistent (HTTP 400).

    Args:
        message: what is wrong and how to fix it.
        param: the offending request field, when there is one.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(ServingError):
    """The requested model / target names nothing this server serves (HTTP 404)."""


class AdapterNotFound(ServingError):
    """No adapter of that name is registered in the pool (HTTP 404)."""


class AdapterExists(ServingError):
    """An adapter of that name is already loaded and no reload was asked for (HTTP 400)."""


class AdapterLoadFailed(ServingError):
    """The adapter folder is missing, malformed or does not fit the base model (HTTP 400)."""


class PathNotAllowed(ServingError):
    """An adapter path resolves outside the configured adapter root (HTTP 403)."""


class NoFreeSlot(ServingError):
    """Every adapter slot holds a pinned or in-use adapter, so nothing can be evicted (HTTP 503)."""


class EngineOverloaded(ServingError):
    """The waiting queue is full (HTTP 429)."""


class EngineNotReady(ServingError):
    """The engine is still loading, shutting down, stopped or failed (HTTP 503)."""


class GenerationFailed(ServingError):
    """The server failed while generating one request (HTTP 500; the message names the request id)."""


class RequestTimedOut(ServingError):
    """The request outlived the server's deadline and was cancelled (HTTP 504)."""


class AdapterPinned(ServingError):
    """A pinned adapter was asked to be unloaded without ``force`` (HTTP 409)."""


class NameReserved(ServingError):
    """A runtime load asked for a name the server reserves: the base model, ``global``, a client (HTTP 400)."""
