"""A worker process's view of batches' cancel marks: one read per batch per period, shared
by its threads; a mark once seen stays."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from tests.fakes import FakeClock
from worker.queue.items import CANCEL_MARK_MAX_AGE_SECONDS, CancelMarks
from worker.queue.jobstore import JobStore


class MarkStore:
    def __init__(self) -> None:
        self.canceled: set[str] = set()
        self.reads = 0

    def batch_canceled(self, batch_id: str) -> bool:
        self.reads += 1
        return batch_id in self.canceled


def test_the_mark_is_read_once_per_period_and_sticks_once_seen() -> None:
    store, clock = MarkStore(), FakeClock()
    marks = CancelMarks(cast(JobStore, store), clock=clock)
    assert not any(marks.canceled("b") for _ in range(50))
    assert store.reads == 1  # fifty items, one read
    store.canceled.add("b")
    assert not marks.canceled("b")  # within the period: the view it had
    clock.sleep(CANCEL_MARK_MAX_AGE_SECONDS)
    assert marks.canceled("b") and store.reads == 2  # seen within one period of the cancel
    clock.sleep(10 * CANCEL_MARK_MAX_AGE_SECONDS)
    assert marks.canceled("b") and store.reads == 2  # a cancel is never undone: no more reads
    assert not marks.canceled("other") and store.reads == 3  # each batch has its own view


def test_threads_that_come_during_a_read_wait_for_it() -> None:
    class SlowStore(MarkStore):
        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def batch_canceled(self, batch_id: str) -> bool:
            self.release.wait(10)
            return super().batch_canceled(batch_id)

    store = SlowStore()
    store.canceled.add("b")
    marks = CancelMarks(cast(JobStore, store), clock=FakeClock())  # time stands still
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(marks.canceled, "b") for _ in range(8)]
        time.sleep(0.05)  # most are in by now: one reading, the others waiting on it
        store.release.set()
        assert [a.result(10) for a in answers] == [True] * 8
    assert store.reads == 1
