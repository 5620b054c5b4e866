"""The backlog admission: a cached reading, all-or-nothing, and admitted work counted at once."""

from __future__ import annotations

import asyncio

import pytest

from api_gateway.backpressure import READ_EVERY_SECONDS, Backlog, BacklogFull


class FakeAsyncReading:
    """``AsyncJobStore.in_flight``: each reading waits until the test releases it."""

    def __init__(self, queued: int, *, released: bool = False) -> None:
        self.queued = queued
        self.reads = 0
        self.release = asyncio.Event()
        if released:
            self.release.set()

    async def __call__(self) -> dict[str, int]:
        self.reads += 1
        await self.release.wait()
        return {"queued": self.queued, "running": 0}


def _backlog(reading: FakeAsyncReading, limit: int, now: list[float]) -> Backlog:
    return Backlog(reading, limit, clock=lambda: now[0])


def test_admits_up_to_the_limit_and_refuses_a_batch_whole() -> None:
    async def scenario() -> None:
        reading, now = FakeAsyncReading(queued=7, released=True), [0.0]
        backlog = _backlog(reading, 10, now)
        await backlog.admit(2)  # 9
        with pytest.raises(BacklogFull) as info:
            await backlog.admit(2)  # 11 > 10: none of the two
        assert "SIFT_MAX_BACKLOG" in str(info.value) and "10" in str(info.value)
        await backlog.admit(1)  # exactly 10
        assert reading.reads == 1  # one reading for the whole burst

    asyncio.run(scenario())


def test_the_reading_is_refreshed_after_half_a_second() -> None:
    async def scenario() -> None:
        reading, now = FakeAsyncReading(queued=10, released=True), [0.0]
        backlog = _backlog(reading, 10, now)
        with pytest.raises(BacklogFull):
            await backlog.admit(1)
        reading.queued, now[0] = 3, READ_EVERY_SECONDS
        await backlog.admit(1)
        assert reading.reads == 2

    asyncio.run(scenario())


def test_zero_is_no_limit() -> None:
    reading = FakeAsyncReading(queued=10**9, released=True)
    asyncio.run(_backlog(reading, 0, [0.0]).admit(10**6))
    assert reading.reads == 0


def test_on_the_event_loop_every_request_waits_for_the_first_reading() -> None:
    async def scenario() -> None:
        reading, now = FakeAsyncReading(queued=8), [0.0]
        backlog = _backlog(reading, 10, now)
        admits = [asyncio.ensure_future(backlog.admit(1)) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(a.done() for a in admits)  # none admitted against "nothing queued"
        reading.release.set()
        outcomes = await asyncio.gather(*admits, return_exceptions=True)
        assert sum(o is None for o in outcomes) == 2  # 8 + 2 = the limit
        assert sum(isinstance(o, BacklogFull) for o in outcomes) == 1
        assert reading.reads == 1

    asyncio.run(scenario())


def test_on_the_event_loop_work_admitted_during_a_reading_is_added_to_it() -> None:
    async def scenario() -> None:
        reading, now = FakeAsyncReading(queued=0), [0.0]
        backlog = _backlog(reading, 10, now)
        reading.release.set()
        await backlog.admit(1)
        reading.release.clear()
        now[0] = READ_EVERY_SECONDS  # due: this request reads, the others use the last one
        refreshing = asyncio.ensure_future(backlog.admit(1))
        await asyncio.sleep(0)
        for _ in range(3):
            await backlog.admit(1)
        reading.queued = 4  # what Redis counts, whether or not it saw those three yet
        reading.release.set()
        await refreshing
        assert reading.reads == 2
        with pytest.raises(BacklogFull) as info:
            await backlog.admit(3)  # 4 + 3 during the reading + 1 + 3 > 10
        assert info.value.queued == 8

    asyncio.run(scenario())


def test_work_admitted_and_not_stored_yet_is_added_to_a_new_reading() -> None:
    async def scenario() -> None:
        reading, now = FakeAsyncReading(queued=0, released=True), [0.0]
        backlog = _backlog(reading, 10, now)
        await backlog.admit(8)
        with backlog.storing(8):  # the store does not count them yet
            now[0] = READ_EVERY_SECONDS
            with pytest.raises(BacklogFull) as info:
                await backlog.admit(3)  # 0 read + 8 being stored + 3 > 10
            assert info.value.queued == 8 and reading.reads == 2
        reading.queued, now[0] = 8, 2 * READ_EVERY_SECONDS  # stored: the store counts them
        await backlog.admit(2)
        assert reading.reads == 3
        with pytest.raises(BacklogFull):
            await backlog.admit(1)

    asyncio.run(scenario())
