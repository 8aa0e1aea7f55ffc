"""The model lock hands itself to waiting threads before the engine's next step (serving.engine.model_lock), and a
request leased while a step runs is admitted by the next one (serving.stack)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from routing.feddpa_options import FedDPAOptions
from serving.engine.model_lock import ModelLock
from serving.engine.sampling import SamplingParams
from serving.stack import Job, StackConfig, Submitted, build_stack
from tests.serving.helpers import write_feddpa_run


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


def test_a_request_for_loaded_adapters_is_queued_while_a_step_runs(tmp_path: Path) -> None:
    """Resolving a target, leasing adapters already in the model and the pool's views never wait for the
    engine's step in flight (they used to, a step each under load); loading an adapter does."""
    run = write_feddpa_run(tmp_path / "run", ("0", "1"), first_seed=2)
    stack = build_stack(StackConfig(model="tiny", run_dir=run, feddpa=FedDPAOptions(routing="fixed"), max_loras=2))
    lock, engine, pool = stack.engine.model_lock, stack.engine, stack.pool
    sampling = SamplingParams(max_tokens=2, temperature=0)
    first = Job(target="global", prompt="Sort: pear, apple", sampling=sampling)
    assert {i.name: i.loaded for i in pool.info()} == {"global": True, "0:local": True, "1:local": False}
    submitted: list[Submitted] = []
    lock.acquire_after_others()  # a step in flight
    try:
        client = threading.Thread(target=lambda: submitted.append(stack.submit(first)))
        client.start()
        client.join(10)
        assert not client.is_alive() and engine.stats().waiting == 1  # queued during the step
        assert "1" in stack.models() and pool.loaded_count() == 2 and pool.info("global")[0].leases == 1
        cold = threading.Thread(target=lambda: submitted.append(stack.submit(Job(target="1", prompt="Hi",
                                                                                 sampling=sampling))))
        cold.start()
        _wait_for(lambda: lock.waiting == 1)  # loading 1:local (evicting 0:local) changes the model: it waits

        assert engine.stats().waiting == 1
    finally:
        lock.release()
    cold.join(10)
    while engine.step():
        pass
    assert [s.handle.result().completion_tokens for s in submitted] == [2, 2]
