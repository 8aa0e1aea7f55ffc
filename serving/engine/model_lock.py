"""The engine's model lock: held for every forward and every change to the model's adapters.

Python's locks are not fair. The engine thread releases the lock at the end of a step and takes it
again a few bytecodes later for the next one, so a thread waiting on it (a request leasing its
adapters, an adapter reload) usually loses the race: under load a submission waited several steps
(seconds) for a lock it holds for microseconds. :class:`ModelLock` counts the threads waiting for it,
and the engine takes it with :meth:`ModelLock.acquire_after_others`, which lets them through first
(for at most ``yield_s``, so a stream of leases cannot starve the engine either).
"""

from __future__ import annotations

import threading
from types import TracebackType


class ModelLock:
    """A re-entrant lock whose ordinary acquirers go before the engine's next step.

    Use it as ``with lock:`` anywhere (the adapter pool, offline generation); the engine's step
    uses :meth:`acquire_after_others` and :meth:`release`.
    """

    def __init__(self, yield_s: float = 0.05) -> None:
        """Create the lock.

        Args:
            yield_s: longest time the engine waits for other threads' turns before it competes for
                the lock like any thread.
        """
        self._lock = threading.RLock()
        self._turns = threading.Condition(threading.Lock())
        self._pending = 0  # threads inside acquire() that do not hold the lock yet
        self.yield_s = yield_s

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock (re-entrant); the engine's next step waits for this thread's turn."""
        with self._turns:
            self._pending += 1
        try:
            return self._lock.acquire(blocking, timeout)
        finally:
            with self._turns:
                self._pending -= 1
                if self._pending == 0:
                    self._turns.notify_all()

    def acquire_after_others(self) -> None:
        """Take the lock once no other thread waits for it (or ``yield_s`` passed): the engine's step."""
        with self._turns:
            self._turns.wait_for(lambda: self._pending == 0, timeout=self.yield_s)
        self._lock.acquire()

    def release(self) -> None:
        """Release one level of the lock."""
        self._lock.release()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock now (not counting its holder)."""
        return self._pending

    def __enter__(self) -> ModelLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
