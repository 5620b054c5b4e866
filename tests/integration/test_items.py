"""The process's batch-item queue against a real Redis: every item is run and accounted for
once, a thread's finish and next start share a round trip, and a broken runner fails its
chunk without stranding the others."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from worker.constants import BATCH_RUNS_KEY, WORKER_HEARTBEAT_KEY
from worker.contract import ErrorInfo, RerankInfo, SearchResult, SearchSpec
from worker.queue.items import Chunk, ItemQueue, RunOutcome
from worker.queue.jobstore import BatchItem, ItemTransition, JobStore

pytestmark = pytest.mark.integration


def result(tag: str) -> SearchResult:
    return SearchResult(hits=[], rerank=RerankInfo(applied=False, fallback_reason=tag))


def make_chunk(store: JobStore, n: int, *, boom: str | None = None) -> tuple[Chunk, list[Any]]:
    batch = store.create_batch(
        "acme", "docs", [(f"q{i}", SearchSpec(index="docs", query=f"q{i}")) for i in range(n)]
    )
    ran: list[str] = []
    finished: list[ItemTransition] = []
    lock = threading.Lock()

    def run(item: BatchItem, started: bool) -> RunOutcome:
        if item.query_id == boom:
            raise RuntimeError(f"runner broke on {boom}")
        if not started:
            return None
        with lock:
            ran.append(item.query_id)
        if item.query_id.endswith("7"):
            return None, ErrorInfo(type="e", message="seven")
        return result(item.query_id), None

    def on_finish(item: BatchItem, transition: ItemTransition, error: ErrorInfo | None) -> None:
        with lock:
            finished.append(transition)

    chunk = Chunk(batch.id, lambda item: item.query_id, run, on_finish)
    items = store.batch_items(batch.id, [f"q{i}" for i in range(n)])
    return chunk, [batch, items, ran, finished]


def test_items_of_concurrent_chunks_run_once_with_one_round_trip_each(
    store: JobStore, round_trips: list[int]
) -> None:
    queue = ItemQueue(store, ThreadPoolExecutor(2))
    chunks = [make_chunk(store, 40) for _ in range(3)]
    with ThreadPoolExecutor(3) as tasks:
        answers = [c.outcomes for c in tasks.map(lambda c: queue.run(c[0], c[1][1]), chunks)]
    for (_, (batch, _, ran, finished)), outcomes in zip(chunks, answers, strict=True):
        assert sorted(ran) == sorted(f"q{i}" for i in range(40))  # each item ran once
        assert len(outcomes) == 40 and sum(done for done, _ in outcomes) == 1
        assert all(t.applied for t in finished) and len(finished) == 40
        got = store.get_batch(batch.id)
        assert got is not None and got.counts["succeeded"] == 36 and got.counts["failed"] == 4
    # 120 starts and 120 finishes: a runner's finish carries its next start
    assert sum(round_trips) == 240
    assert len(round_trips) < 150


def test_a_broken_runner_fails_its_chunk_and_the_rest_still_run(store: JobStore) -> None:
    queue = ItemQueue(store, ThreadPoolExecutor(2))
    broken, (_, broken_items, broken_ran, _) = make_chunk(store, 20, boom="q3")
    failed = queue.run(broken, broken_items)
    assert isinstance(failed.error, RuntimeError) and "runner broke on q3" in str(failed.error)
    assert "q3" not in broken_ran and len(broken_ran) == 19  # every other item still ran
    assert len(failed.outcomes) == 20  # q3 is accounted for, as failed
    healthy, (batch, items, ran, _) = make_chunk(store, 20)
    done = queue.run(healthy, items)  # the pool is not stuck
    outcomes = done.outcomes
    assert done.error is None
    assert len(outcomes) == 20 and sorted(ran) == sorted(f"q{i}" for i in range(20))
    got = store.get_batch(batch.id)
    assert got is not None and got.finished_at is not None


def test_items_started_before_a_cancel_are_canceled_at_their_next_start(store: JobStore) -> None:
    """A chunk redelivered after a cancel (its first worker died with the items running):
    each item's start reads the cancel mark and cancels it instead; none runs, each is
    accounted for, and the batch completes once, ``canceled``."""
    queue = ItemQueue(store, ThreadPoolExecutor(2))
    chunk, (batch, _, ran, finished) = make_chunk(store, 10)
    for i in range(10):
        assert store.start_item(batch.id, f"q{i}")  # the dead worker's
    assert store.cancel_batch(batch.id) == (0, False)  # nothing queued to cancel
    items = store.batch_items(batch.id, [f"q{i}" for i in range(10)])
    done = queue.run(chunk, items)
    assert ran == [] and done.error is None
    assert len(done.outcomes) == 10 and sum(completed for completed, _ in done.outcomes) == 1
    assert len(finished) == 10 and all(t.applied and t.canceled for t in finished)
    got = store.get_batch(batch.id)
    assert got is not None and got.status == "canceled" and got.counts["canceled"] == 10


def test_hand_back_returns_the_items_not_started_and_lets_the_running_ones_finish(
    store: JobStore,
) -> None:
    """SIGTERM: the queue hands back what no runner has started; those items stay
    ``queued`` (for the chunk's next delivery), and the ones running finish."""
    queue = ItemQueue(store, ThreadPoolExecutor(2))
    chunk, (batch, items, ran, _) = make_chunk(store, 20)
    inner = chunk.run
    both_started = threading.Barrier(3)  # the pool's two runners, and the test
    release = threading.Event()

    def slow(item: BatchItem, started: bool) -> RunOutcome:
        if item.query_id in ("q0", "q1"):
            both_started.wait(10)
            release.wait(10)
        return inner(item, started)

    chunk.run = slow
    outcome: list[Chunk] = []
    task = threading.Thread(target=lambda: outcome.append(queue.run(chunk, items)))
    task.start()
    both_started.wait(10)
    queue.hand_back()
    release.set()
    task.join(10)
    assert outcome and outcome[0].error is None
    assert len(ran) == 2 and chunk.handed_back == 18  # two runners had each started one
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts["succeeded"] == 2 and got.counts["queued"] == 18
    assert got.counts["running"] == 0
    # a chunk arriving after the hand-back runs nothing
    late, (_, late_items, late_ran, _) = make_chunk(store, 5)
    assert queue.run(late, late_items).handed_back == 5 and not late_ran


class RecordingIntake:
    """The process's reading of the batch queue, with the number of items waiting at each
    pause and resume (what the pause does to the consumer: tests/unit/test_intake.py)."""

    def __init__(self, queue: list[ItemQueue]) -> None:
        self.queue = queue
        self.events: list[tuple[str, int]] = []

    def pause(self) -> None:
        self.events.append(("pause", len(self.queue[0]._queue)))

    def resume(self) -> None:
        self.events.append(("resume", len(self.queue[0]._queue)))


def test_the_intake_pauses_at_a_pools_worth_waiting_and_resumes_at_half(store: JobStore) -> None:
    """With 2 threads and 10 items a pool's worth, a 40-item chunk pauses the process's
    batch-queue intake as it is queued (40 waiting) and resumes it once fewer than 5 wait;
    every item still runs once."""
    holder: list[ItemQueue] = []
    intake = RecordingIntake(holder)
    queue = ItemQueue(store, ThreadPoolExecutor(2), intake, high=10)
    holder.append(queue)
    chunk, (_, items, ran, _) = make_chunk(store, 40)
    queue.run(chunk, items)
    assert sorted(ran) == sorted(f"q{i}" for i in range(40))
    assert [kind for kind, _ in intake.events] == ["pause", "resume"]
    assert intake.events[0][1] >= 10 and intake.events[1][1] < 5
    small, (_, few, _, _) = make_chunk(store, 5)
    queue.run(small, few)  # 5 waiting at most: below the mark, no pause
    assert len(intake.events) == 2


def test_a_chunk_s_starts_judge_a_claim_kept_without_a_lease_by_the_chunk_s_lease(
    store: JobStore,
) -> None:
    """Items whose run claim an older release wrote (no lease in it), its worker alive: the
    chunk's starts (the first, and the one sent with a finish) judge it by the chunk's lease,
    as the claim would, and leave the items as they are."""
    chunk, (batch, items, ran, _) = make_chunk(store, 3)
    chunk.claimant = ("w2", 30.0)
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    now, micros = store.redis.time()
    for qid in ("q1", "q2"):
        store.redis.hset(BATCH_RUNS_KEY + batch.id, qid, f"0|w1|{now}.{micros:06d}|t0ken")
    ItemQueue(store, ThreadPoolExecutor(1)).run(chunk, items)
    assert ran == ["q0"]
    statuses = [i.status for i in store.batch_items(batch.id, ["q0", "q1", "q2"])]
    assert statuses == ["succeeded", "queued", "queued"], statuses
