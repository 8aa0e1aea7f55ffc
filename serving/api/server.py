"""How ``fedmosaic serve`` runs the app under uvicorn: connection limits, read timeouts, a key-free access log.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``), requests in flight
(``limit_concurrency``: 503 beyond) and the size of a request head (h11's
``max_incomplete_event_size``), but not how long a fresh connection may take to send its request
head: :class:`HeadTimeoutH11` closes a connection whose head has not arrived ``header_timeout_s`` after
it connected or after its previous response (a socket opened and left silent would otherwise be held
for good). The body's deadline is :class:`serving.api.app.BodyLimit`'s. The access log never shows a
query string, where a client may have put its key (``?api_key=...``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.settings import ServeSettings

ACCESS_LOGGER = "uvicorn.access"


class HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late (``header_timeout_s``)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # narrowed as in uvicorn's H11Protocol
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head is due in header_timeout_s too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._late)

    def _late(self) -> None:
        # IDLE: no complete request head since the timer was armed (a request being answered is not IDLE)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class HideQuery(logging.Filter):
    """Drop the query string of the request path in uvicorn's access log lines (keys never logged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?...", *args[3:])
        return True


def hide_query_strings() -> None:
    """Install :class:`HideQuery` on uvicorn's access logger (once)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, HideQuery) for f in logger.filters):
        logger.addFilter(HideQuery())


def uvicorn_options(settings: ServeSettings) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` for ``settings`` (limits and protocol)."""
    protocol = type("HeadTimeoutH11", (HeadTimeoutH11,), {"header_timeout_s": settings.header_timeout_s})
    return {"host": settings.host, "port": settings.port, "http": protocol,
            "timeout_keep_alive": settings.keep_alive_s, "limit_concurrency": settings.max_connections,
            "h11_max_incomplete_event_size": settings.max_header_bytes}
