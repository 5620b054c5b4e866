"""The backlog admission: a cached reading, all-or-nothing, and admitted work counted at once."""

from __future__ import annotations

from typing import Any, cast

import pytest

from api_gateway.backpressure import READ_EVERY_SECONDS, Backlog, BacklogFull
from worker.jobstore import JobStore


class FakeStore:
    def __init__(self, queued: int) -> None:
        self.queued = queued
        self.reads = 0

    def in_flight(self) -> dict[str, int]:
        self.reads += 1
        return {"queued": self.queued, "running": 0}


def _backlog(store: FakeStore, limit: int, now: list[float]) -> Backlog:
    return Backlog(cast(JobStore, cast(Any, store)), limit, clock=lambda: now[0])


def test_admits_up_to_the_limit_and_refuses_a_batch_whole() -> None:
    store, now = FakeStore(queued=7), [0.0]
    backlog = _backlog(store, 10, now)
    backlog.admit(2)  # 9
    with pytest.raises(BacklogFull) as info:
        backlog.admit(2)  # 11 > 10: none of the two
    assert "SIFT_MAX_BACKLOG" in str(info.value) and "10" in str(info.value)
    backlog.admit(1)  # exactly 10
    assert store.reads == 1  # one reading for the whole burst


def test_the_reading_is_refreshed_after_half_a_second() -> None:
    store, now = FakeStore(queued=10), [0.0]
    backlog = _backlog(store, 10, now)
    with pytest.raises(BacklogFull):
        backlog.admit(1)
    store.queued, now[0] = 3, READ_EVERY_SECONDS
    backlog.admit(1)
    assert store.reads == 2


def test_zero_is_no_limit() -> None:
    store = FakeStore(queued=10**9)
    _backlog(store, 0, [0.0]).admit(10**6)
    assert store.reads == 0
