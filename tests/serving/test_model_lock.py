"""The model lock hands itself to waiting threads before the engine's next step (serving.model_lock)."""

from __future__ import annotations

import threading
import time

from serving.model_lock import ModelLock


def _wait_for(predicate, limit: float = 10.0) -> None:
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.001)


def test_a_waiting_thread_goes_before_the_engine_s_next_step() -> None:
    lock = ModelLock(yield_s=10.0)
    order: list[str] = []
    for _ in range(20):  # the plain RLock loses this race most of the time: repeat it
        order.clear()
        lock.acquire_after_others()  # the engine's step
        other = threading.Thread(target=lambda: (lock.acquire(), order.append("lease"), lock.release()))
        other.start()
        _wait_for(lambda: lock.waiting == 1)
        lock.release()  # the step ends ...
        lock.acquire_after_others()  # ... and the next one starts at once
        order.append("step")
        lock.release()
        other.join(10)
        assert order == ["lease", "step"]
    assert lock.waiting == 0


def test_the_engine_waits_at_most_yield_s_and_the_lock_is_reentrant() -> None:
    lock = ModelLock(yield_s=0.01)
    lock.acquire_after_others()
    blocked = threading.Thread(target=lambda: (lock.acquire(), lock.release()))
    blocked.start()
    _wait_for(lambda: lock.waiting == 1)
    # The holder takes it again while another thread waits: no deadlock, the wait is bounded.
    lock.acquire_after_others()
    with lock:  # re-entrant through the context manager as well
        assert lock.waiting == 1
    lock.release()
    lock.release()
    blocked.join(10)
    assert not blocked.is_alive() and lock.waiting == 0


def test_a_timed_out_acquire_is_not_counted_as_waiting() -> None:
    lock = ModelLock()
    lock.acquire_after_others()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(lock.acquire(timeout=0.01)))
    t.start()
    t.join(10)
    assert result == [False] and lock.waiting == 0
    lock.release()
