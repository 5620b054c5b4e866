"""The backlog admission: all-or-nothing, and admitted work held until its job is stored;
the job store's memory admission: a batch judged with the bytes it will add."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from api_gateway.backpressure import (
    HIT_BYTES,
    HIT_OVERHEAD_BYTES,
    READ_EVERY_SECONDS,
    STORED_FACTOR,
    TRACE_BYTES,
    Backlog,
    BacklogFull,
    StoreFull,
    StoreMemory,
    TooLargeForStore,
    batch_bytes,
    hit_bytes,
    results_bytes,
    trace_candidate_bytes,
)
from api_gateway.jobs._shared import results_size


class FakeHolds:
    """``AsyncJobStore.hold_backlog`` and ``release_backlog`` over a queued count: the
    script's decision, without Redis (tests/reliability/test_backpressure.py runs the real
    one across two gateways)."""

    def __init__(self, queued: int) -> None:
        self.queued = queued
        self.held: dict[str, int] = {}
        self.fail_release = False

    async def hold(self, token: str, items: int, limit: int, seconds: float) -> int | None:
        counted = self.queued + sum(self.held.values())
        if counted + items > limit:
            return counted
        self.held[token] = items
        return None

    async def release(self, token: str) -> None:
        if self.fail_release:
            raise redis.ConnectionError("gone")
        del self.held[token]


def test_admits_up_to_the_limit_and_refuses_a_batch_whole() -> None:
    async def scenario() -> None:
        holds = FakeHolds(queued=7)
        backlog = Backlog(holds.hold, holds.release, 10)
        async with backlog.admitted(2):  # 9, held while its job is stored
            assert sum(holds.held.values()) == 2
            with pytest.raises(BacklogFull) as info:
                async with backlog.admitted(2):  # 11 > 10: none of the two
                    pass
            assert "SIFT_MAX_BACKLOG" in str(info.value) and info.value.queued == 9
            assert "9" not in info.value.public  # every tenant's count: not the caller's
        assert holds.held == {}  # stored: the store counts it from then on

    asyncio.run(scenario())


def test_zero_is_no_limit() -> None:
    async def scenario() -> None:
        holds = FakeHolds(queued=10**9)
        async with Backlog(holds.hold, holds.release, 0).admitted(10**6):
            assert holds.held == {}

    asyncio.run(scenario())


def test_a_hold_not_dropped_leaves_the_job_s_answer_as_it_was() -> None:
    async def scenario() -> None:
        holds = FakeHolds(queued=0)
        holds.fail_release = True
        async with Backlog(holds.hold, holds.release, 10).admitted(1):
            pass  # stored: a 202 stands, and the hold lapses in Redis

    asyncio.run(scenario())


def test_a_batch_is_judged_with_the_bytes_it_adds_and_counted_until_the_next_reading() -> None:
    """At 80 % of maxmemory a batch that would take Redis past 90 % is refused (it was taken:
    only the memory held was read); one that fits is taken and counted, so the next one
    before a new reading is judged with it; a new reading replaces the count."""

    async def scenario() -> None:
        now, held = [0.0], [800]

        async def read() -> tuple[int, int]:
            return held[0], 1_000

        memory = StoreMemory(read, clock=lambda: now[0])
        with pytest.raises(StoreFull) as info:
            await memory.admit(150, "this batch of 3 queries")
        said = str(info.value)
        assert "no room for this batch of 3 queries" in said and "80%" in said, said
        assert "past 90%" in said and "nothing was stored" in said, said
        public = info.value.public  # the client's: not what Redis holds, every tenant's work
        assert "no room for this batch of 3 queries" in public and "80%" not in public, public
        await memory.admit(60, "a batch")  # 860
        with memory.storing(60):
            pass  # stored, as the gateway stores what it admits
        with pytest.raises(StoreFull):
            await memory.admit(60, "a batch")  # 920, counted with the first
        await memory.admit()  # a search: nothing added to judge
        now[0] += READ_EVERY_SECONDS
        held[0] = 810  # the reading now holds the first batch
        await memory.admit(60, "a batch")

    asyncio.run(scenario())


def test_bytes_admitted_and_not_stored_yet_are_added_to_a_new_reading() -> None:
    """A batch's bytes are in what Redis holds with the results owed only once its commit is
    written: a reading taken while it is being stored counts them (it dropped them, and the
    next batch was admitted against it), and one taken after it was stored counts them once."""

    async def scenario() -> None:
        now, held = [0.0], [800]

        async def read() -> tuple[int, int]:
            return held[0], 1_000

        memory = StoreMemory(read, clock=lambda: now[0])
        await memory.admit(60, "a batch")  # 860
        with memory.storing(60):  # not in Redis's reading yet
            now[0] += READ_EVERY_SECONDS
            with pytest.raises(StoreFull) as info:
                await memory.admit(60, "a batch")  # 800 read + 60 being stored + 60
            assert "86%" in str(info.value), info.value
        held[0], now[0] = 860, now[0] + READ_EVERY_SECONDS  # stored: owed in the store
        await memory.admit(30, "a batch")  # 890
        with pytest.raises(StoreFull):
            await memory.admit(10, "a batch")

    asyncio.run(scenario())


def test_a_reading_counts_what_was_being_stored_when_it_started() -> None:
    """A job stored while a reading is in flight may or may not be in what it reads: it is
    counted on top, so the reading errs high, never low."""

    async def scenario() -> None:
        now, gate = [0.0], asyncio.Event()

        async def read() -> tuple[int, int]:
            await gate.wait()
            return 800, 1_000  # the commit not seen

        memory = StoreMemory(read, clock=lambda: now[0])
        gate.set()
        await memory.admit(40, "a batch")
        gate.clear()
        with memory.storing(40):
            now[0] += READ_EVERY_SECONDS
            reading = asyncio.ensure_future(memory.limited())
            await asyncio.sleep(0)
        gate.set()
        await reading
        with pytest.raises(StoreFull):
            await memory.admit(60, "a batch")  # 800 + 40 + 60

    asyncio.run(scenario())


def test_a_batch_larger_than_the_share_new_jobs_may_fill_is_refused_for_good() -> None:
    """Retrying it would never help, even on an empty Redis: not the 503 that says retry."""

    async def scenario() -> None:
        async def read() -> tuple[int, int]:
            return 0, 1_000_000

        memory = StoreMemory(read)
        with pytest.raises(TooLargeForStore) as info:
            await memory.admit(900_000, "this batch of 9 queries")
        said = str(info.value)
        assert said.startswith("this batch of 9 queries would take about 0.9 MB"), said
        assert "no retry admits it" in said and "smaller batches" in said, said
        await memory.admit(899_999, "this batch of 9 queries")

    asyncio.run(scenario())


def test_a_batch_s_bytes_grow_with_its_specs_its_hits_and_its_traces() -> None:
    one = batch_bytes([("q1", "{}")], hits=10)
    assert batch_bytes([("q1", "{}" + "x" * 100)], hits=10) == one + 100
    assert batch_bytes([("q1", "{}")], hits=100) > 5 * one
    assert batch_bytes([("q1", "{}")], hits=10, traced=10) > 1.5 * one
    # an economy item's record, kept while it waits at the provider, priced as a trace
    assert batch_bytes([("q1", "{}")], hits=10, waiting=10) == batch_bytes(
        [("q1", "{}")], hits=10, traced=10
    )
    assert batch_bytes([("q1", "{}"), ("q2", "{}")], hits=20) == 2 * one


def test_a_hit_is_priced_by_its_index_s_mean_document_or_the_fixed_size_when_unknown() -> None:
    """A hit carries its document's title, text and metadata into the result: one over an
    index of documents of 99,000 bytes weighs 99 kB, not the sample corpus's 420 B."""
    assert hit_bytes(None) == HIT_BYTES
    assert hit_bytes((0, 0)) == HIT_BYTES  # no document recorded: nothing to measure
    assert hit_bytes((100, 9_900_000)) == HIT_OVERHEAD_BYTES + 99_000
    assert hit_bytes((3, 10)) == HIT_OVERHEAD_BYTES + 4  # rounded up
    long = batch_bytes([("q1", "{}")], hits=100, per_hit=hit_bytes((1, 99_000)))
    assert long > 9_900_000 > 100 * batch_bytes([("q1", "{}")], hits=100)


def test_a_search_or_batch_is_priced_only_when_redis_has_a_maxmemory() -> None:
    """Without a ``maxmemory`` no admission reads the bytes a job adds, so the gateway does
    not read its index's size from Redis for every search (what its result owes is priced at
    the fixed size); with one, it does, and what it owes is priced by its index too."""

    class Store:
        def __init__(self) -> None:
            self.sizes_read = 0

        async def index_size(self, tenant: str, index: str) -> tuple[int, int]:
            self.sizes_read += 1
            return 10, 99_000

    def request(limit: int, store: Store) -> Any:
        async def read() -> tuple[int, int]:
            return 0, limit

        settings = SimpleNamespace(rerank_candidate_max_chars=1_200)
        state = SimpleNamespace(memory=StoreMemory(read), async_store=store, settings=settings)
        return SimpleNamespace(app=SimpleNamespace(state=state))

    async def scenario() -> None:
        unlimited, limited = Store(), Store()
        args = ("acme", "docs", [("", "{}")], 10, 0, "this search")
        owed = results_bytes(1, 10)
        assert await results_size(request(0, unlimited), *args) == (0, owed, "this search")
        assert unlimited.sizes_read == 0
        adding, owed, what = await results_size(request(1 << 30, limited), *args)
        assert limited.sizes_read == 1
        assert adding == batch_bytes([("", "{}")], 10, per_hit=hit_bytes((10, 99_000)))
        assert owed == results_bytes(1, 10, per_hit=hit_bytes((10, 99_000))) == adding - 2
        assert "index 'docs'" in what
        # an economy item's window of 30 candidates, kept while it waits, priced as a trace's
        # (cut), up to the index's 10 documents
        adding, owed, what = await results_size(request(1 << 30, limited), *args, 30)
        per_hit, per_candidate = hit_bytes((10, 99_000)), trace_candidate_bytes((10, 99_000), 1_200)
        assert owed == results_bytes(1, 10, 0, per_hit, per_candidate, 10) == adding - 2
        listed = (TRACE_BYTES + 10 * 1_450) * STORED_FACTOR  # as Redis holds it
        assert owed - results_bytes(1, 10, per_hit=per_hit) == listed
        assert "10 candidates kept while waiting at the provider" in what

    asyncio.run(scenario())
