"""The re-drive against a real Redis and a real worker: a task message dropped off the broker,
exactly as kombu's pop-then-unacked window loses it, is found and sent again, and nothing
that is merely waiting (in a queue or held unacked) is ever sent twice."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue
from prometheus_client import REGISTRY

from api_gateway.queue import OutboxSender
from tests.integration.beats import BEAT, Beats, check_twice
from tests.reliability.support import broker
from tests.services import celery_worker
from worker.constants import (
    ACTIVE_JOBS_KEY,
    ATTEMPTS_KEY,
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    DELIVERY_OWNERS_KEY,
    ECONOMY_PREPARED_KEY,
    INGEST_QUEUE,
    INGEST_TASK,
    KOMBU_UNACKED_KEY,
    REDRIVE_LEADER_KEY,
    REDRIVE_SUSPECTS_KEY,
    REDRIVE_URGENT_KEY,
    REDRIVE_WEBHOOK_SUSPECTS_KEY,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
    WEBHOOKS_OWED_KEY,
)
from worker.contract import DocumentIn, RerankInfo, SearchResult, SearchSpec
from worker.queue.celery_app import create_celery_app
from worker.queue.jobstore import BatchJob, IngestJob, JobStore, SearchJob, webhook_event
from worker.queue.jobstore.delivery import FREE_OUTAGE_REDRIVES
from worker.queue.reaper import Reaper, heartbeat_key
from worker.queue.redrive import Coverage, Redrive, Sweeper, celery_sender, coverage
from worker.settings import load_settings

pytestmark = pytest.mark.integration

MAX_DELIVERIES = 2
HOOK = "https://example.com/hook"
RESULT = SearchResult(hits=[], rerank=RerankInfo(applied=False))


@pytest.fixture(scope="module")
def app(redis_url: str) -> Iterator[Celery]:
    """The worker's own Celery app: the sweeper sends through it, as in a worker."""
    celery = create_celery_app(load_settings(redis_url=redis_url))
    yield celery
    celery.close()


@pytest.fixture
def sweeper(store: JobStore, app: Celery) -> Sweeper:
    """Every active job counts as idle (stall 0); sweeps are run by hand, one call each."""
    return Sweeper(
        store,
        celery_sender(app),
        interval_seconds=1.0,
        stall_seconds=0.0,
        chunk_size=10,
        max_deliveries=MAX_DELIVERIES,
    )


def worker_env(redis_url: str) -> dict[str, str]:
    return {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_RUNTIME_FACTORY": "tests.integration.dying_runtime:build_runtime",
        "SIFT_TASK_MAX_DELIVERIES": str(MAX_DELIVERIES),
        "SIFT_BATCH_CHUNK_SIZE": "10",
        "SIFT_WORKER_METRICS_PORT": "0",
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        "SIFT_REDRIVE_INTERVAL_SECONDS": "0",  # these tests sweep by hand
    }


def create_batch(store: JobStore, total: int = 25, lane: str = "standard") -> BatchJob:
    """A batch submitted as the gateway does: record and chunk messages in one MULTI."""
    outbox = OutboxSender(store)
    items = [(f"q{i:02d}", SearchSpec(index="docs", query=f"query {i}")) for i in range(total)]
    return store.create_batch(
        "acme",
        "docs",
        items,
        lane=lane,
        enqueue=lambda bid: outbox.messages(
            [
                (BATCH_CHUNK_TASK, [bid, start, min(start + 10, total)], BATCH_QUEUE)
                for start in range(0, total, 10)
            ]
        ),
    )


def create_search(store: JobStore, query: str = "tea") -> SearchJob:
    outbox = OutboxSender(store)
    return store.create_search(
        "acme",
        SearchSpec(index="docs", query=query),
        enqueue=lambda job_id: outbox.messages([(SEARCH_TASK, [job_id], SEARCH_QUEUE)]),
    )


def lose_oldest(store: JobStore, queue: str) -> Coverage | None:
    """Take the next message off ``queue`` and drop it: a worker that BRPOPped it and died."""
    raw = store.redis.rpop(queue)
    assert isinstance(raw, str)
    return coverage(json.loads(raw))


def queued(store: JobStore, queue: str) -> list[Coverage | None]:
    return [coverage(json.loads(raw)) for raw in store.redis.lrange(queue, 0, -1)]


def messages_of(store: JobStore, job_id: str) -> list[str]:
    """The raw messages of one search job in its queue."""
    return [
        raw
        for raw in store.redis.lrange(SEARCH_QUEUE, 0, -1)
        if (found := coverage(json.loads(raw))) is not None and found.job_id == job_id
    ]


def wait_until(
    check: Callable[[], object], what: str, timeout: float = 60.0, log: Path | None = None
) -> None:
    """Poll ``check`` until it is true; fail naming ``what``, with the tail of a worker's
    ``log`` if given (what the worker saw explains what it did not do)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    tail = f"\n{log.name}:\n{log.read_text(errors='replace')[-4000:]}" if log else ""
    raise AssertionError(f"{what}: not within {timeout:g}s{tail}")


def test_a_lost_chunk_is_redriven_once_and_the_batch_completes_exactly_once(
    store: JobStore, sweeper: Sweeper, redis_url: str, tmp_path: Path
) -> None:
    batch = create_batch(store)
    assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))

    assert sweeper.sweep() == []  # seen lost once: it may just be moving between two keys
    assert store.redis.hgetall(REDRIVE_SUSPECTS_KEY) == {batch.id: "[[0, 10]]"}
    assert sweeper.sweep() == [Redrive(batch.id, "batch", [(0, 10)], poison=False)]
    assert sorted(c.positions.start for c in queued(store, BATCH_QUEUE) if c) == [0, 10, 20]
    assert sweeper.sweep() == []  # covered again: nothing more is sent
    assert store.redis.llen(BATCH_QUEUE) == 3

    with celery_worker(tmp_path / "w", worker_env(redis_url), "redrive"):
        wait_until(lambda: (store.get_batch(batch.id) or batch).finished_at, "batch finished")
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded"
    assert done.counts == {"queued": 0, "running": 0, "succeeded": 25, "failed": 0, "canceled": 0}
    outcomes = store.batch_results(batch.id, 0, 100)
    assert [o.query_id for o in outcomes] == [f"q{i:02d}" for i in range(25)]
    assert {o.status for o in outcomes} == {"succeeded"}
    assert store.redis.zscore(ACTIVE_JOBS_KEY, batch.id) is None  # no longer watched


def test_the_cap_counts_each_position_s_re_drives_not_its_batch_s(
    store: JobStore, sweeper: Sweeper
) -> None:
    """The re-drive's cap (``max_deliveries``, 2 here) counts how often each of a batch's
    positions was re-driven: its three chunks each lost once, one after the other, go out
    again as they were, and so does the first chunk lost a second time; only its third loss
    sends it spent. The cap counted the batch's re-drives, so a chunk lost once went out
    spent once the batch's other chunks had been (its items failed as poison in the economy
    lane, which judges its items by their chunk's deliveries)."""
    batch = create_batch(store)
    for start in (0, 10, 20):  # each chunk lost once, one after the other
        stop = min(start + 10, 25)
        assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(start, stop))
        assert sweeper.sweep() == []
        (again,) = sweeper.sweep()
        assert again.chunks == [(start, stop)] and not again.poison, again
    for losses in (2, 3):  # the first chunk's message lost again, and again
        (message,) = [
            raw
            for raw in store.redis.lrange(BATCH_QUEUE, 0, -1)
            if (found := coverage(json.loads(raw))) is not None and found.positions.start == 0
        ]
        assert store.redis.lrem(BATCH_QUEUE, 1, message) == 1
        assert sweeper.sweep() == []
        (again,) = sweeper.sweep()
        assert again.chunks == [(0, 10)] and again.poison == (losses > MAX_DELIVERIES), again


def test_a_chunk_a_live_run_holds_by_its_claim_is_left_to_it_until_its_worker_dies(
    store: JobStore, sweeper: Sweeper
) -> None:
    """A copy of a running chunk's message is refused by the chunk's run claim and acked;
    kombu's restore at a reconnect had moved the run's own message to that copy, so no
    message covers the chunk while its live run works through it. The re-drive leaves it to
    that run: it re-drove it, the copy was refused again, and each copy spent one of the
    batch's re-drives (past the cap, one over other positions ran as poison beside the run).
    Once the run's worker is dead, or the run has let go, the chunk is lost as before."""
    batch = create_batch(store)
    assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))
    store.redis.set(heartbeat_key("w1"), "1", px=60_000)
    assert store.claim_chunk(batch.id, 0, 10, "w1", lease_seconds=770).granted
    for _ in range(3):
        assert sweeper.sweep() == []
    store.redis.delete(heartbeat_key("w1"))  # its worker dies
    assert sweeper.sweep() == []  # seen lost once
    assert sweeper.sweep() == [Redrive(batch.id, "batch", [(0, 10)], poison=False)]
    lose_oldest(store, BATCH_QUEUE)  # [10, 20), its run's claim let go (a retry's message lost)
    store.redis.set(heartbeat_key("w2"), "1", px=60_000)
    ran = store.claim_chunk(batch.id, 10, 20, "w2", lease_seconds=770)
    store.release_chunk(batch.id, 10, 20, ran)
    assert sweeper.sweep() == []
    assert sweeper.sweep() == [Redrive(batch.id, "batch", [(10, 20)], poison=False)]


def test_waiting_messages_are_never_redriven(store: JobStore, sweeper: Sweeper) -> None:
    """Chunks queued behind a backlog, one held unacked by a worker (running, or waiting out a
    retry's countdown), and a queued search: idle, all of them, and none lost."""
    batch = create_batch(store)
    search = create_search(store)
    raw = store.redis.rpop(BATCH_QUEUE)
    assert isinstance(raw, str)
    envelope = json.loads(raw)
    tag = envelope["properties"]["delivery_tag"]  # what kombu's QoS.append writes
    store.redis.hset(KOMBU_UNACKED_KEY, tag, json.dumps([envelope, BATCH_QUEUE, BATCH_QUEUE]))
    store.redis.zadd(KOMBU_UNACKED_KEY + "_index", {tag: time.time()})
    store.start_item(batch.id, "q00")  # its worker is running it

    for _ in range(3):
        assert sweeper.sweep() == []
    assert store.redis.exists(REDRIVE_SUSPECTS_KEY) == 0
    assert store.redis.llen(BATCH_QUEUE) == 2 and store.redis.llen(SEARCH_QUEUE) == 1
    assert set(store.stalled_jobs(0)) == {batch.id, search.id}


def test_a_job_that_moves_between_sweeps_is_not_redriven(
    store: JobStore, app: Celery, sweeper: Sweeper
) -> None:
    """Found lost once, then progress: the next sweep (idle threshold 60 s) leaves it alone."""
    batch = create_batch(store)
    lose_oldest(store, BATCH_QUEUE)
    assert sweeper.sweep() == []
    store.start_item(batch.id, "q01")  # a worker had it after all
    patient = Sweeper(store, celery_sender(app), interval_seconds=1, stall_seconds=60)
    assert patient.sweep() == []
    assert store.redis.llen(BATCH_QUEUE) == 2


def test_a_lost_search_is_redriven_and_past_the_cap_sent_as_poison(
    store: JobStore, sweeper: Sweeper, redis_url: str, tmp_path: Path
) -> None:
    lost_once, lost_always = create_search(store), create_search(store)
    assert lose_oldest(store, SEARCH_QUEUE) == Coverage(lost_once.id, range(0, 1))
    assert lose_oldest(store, SEARCH_QUEUE) == Coverage(lost_always.id, range(0, 1))
    waiting = create_search(store)

    assert sweeper.sweep() == []
    redriven = sweeper.sweep()
    assert sorted(r.job_id for r in redriven) == sorted([lost_once.id, lost_always.id])
    assert {r.kind for r in redriven} == {"search"} and not any(r.poison for r in redriven)
    assert sorted(c.job_id for c in queued(store, SEARCH_QUEUE) if c) == sorted(
        [lost_once.id, lost_always.id, waiting.id]
    )

    # lost_always keeps losing its message: re-driven MAX_DELIVERIES times, then as poison
    for redrives in range(2, MAX_DELIVERIES + 2):
        (message,) = messages_of(store, lost_always.id)
        store.redis.lrem(SEARCH_QUEUE, 1, message)
        assert sweeper.sweep() == []
        (again,) = sweeper.sweep()
        assert again.job_id == lost_always.id
        assert again.poison == (redrives > MAX_DELIVERIES)
    (poison,) = messages_of(store, lost_always.id)
    task_id = json.loads(poison)["headers"]["id"]
    assert store.redis.get(f"{ATTEMPTS_KEY}{task_id}:0") == str(MAX_DELIVERIES)  # spent

    with celery_worker(tmp_path / "w", worker_env(redis_url), "redrive"):
        for job in (lost_once, lost_always, waiting):
            wait_until(lambda job=job: (store.get_search_status(job.id) or "").final, job.id)
    assert store.get_search_status(lost_once.id) == "succeeded"
    assert store.get_search_status(waiting.id) == "succeeded"
    failed = store.get_search(lost_always.id)
    assert failed is not None and failed.status == "failed"
    assert failed.error is not None and failed.error.type == "delivery_limit_exceeded"
    assert store.redis.zcard(ACTIVE_JOBS_KEY) == 0


def test_a_re_drive_an_outage_ended_is_not_counted_and_only_so_often(
    store: JobStore, sweeper: Sweeper
) -> None:
    """A search whose run met Redis unreachable past its client's retries notes the outage
    once Redis answers (``note_outage``), and the re-drive that sends it again is not counted:
    lost that way more often than the cap, it still goes out as it was (each was counted, and
    past the cap it went out as poison, failing a search with no fault of its own). Free at
    most ``FREE_OUTAGE_REDRIVES`` times: past that its re-drives count as any other's; so
    with the deliveries of its message a note leaves uncounted. A batch's note frees the
    positions it names alone."""
    search = create_search(store)
    for _ in range(FREE_OUTAGE_REDRIVES):
        lose_oldest(store, SEARCH_QUEUE)
        store.note_outage(search.id, [0])
        assert sweeper.sweep() == []
        assert sweeper.sweep() == [Redrive(search.id, "search", [(0, 1)], poison=False)]
    for redrives in range(1, MAX_DELIVERIES + 2):  # noted still, but counted now
        lose_oldest(store, SEARCH_QUEUE)
        store.note_outage(search.id, [0])
        assert sweeper.sweep() == []
        (again,) = sweeper.sweep()
        assert again.poison == (redrives > MAX_DELIVERIES), again
    delivered = []  # its message put back after each outage (its ack lost): uncounted as often
    for _ in range(FREE_OUTAGE_REDRIVES + 2):
        delivered.append(store.count_delivery("outage-msg", 0, search.id))
        store.note_outage(search.id, [0], ("outage-msg", 0))
    assert delivered == [1] * (FREE_OUTAGE_REDRIVES + 1) + [2], delivered

    batch = create_batch(store, total=10)  # one chunk, its positions 0 to 4 in their runs
    for losses in range(1, MAX_DELIVERIES + 2):
        assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))
        store.note_outage(batch.id, range(0, 5))
        assert sweeper.sweep() == []
        (sent,) = sweeper.sweep()
        if losses <= MAX_DELIVERIES:
            assert (sent.chunks, sent.poison) == ([(0, 10)], False), sent
        else:  # the positions no outage freed are spent; the others go out as they were
            assert (sent.chunks, sent.poison) == ([(0, 5), (5, 10)], True), sent


def test_an_outage_whose_message_came_back_itself_frees_no_later_re_drive(
    store: JobStore, app: Celery
) -> None:
    """A search's run meets Redis unreachable and notes the outage; its ack lost, the same
    message comes back (the orphan check), and that delivery is not counted. The note paid for
    that return: the losses after it (a worker killed by this job) are counted, and at the
    default ``SIFT_TASK_MAX_DELIVERIES`` the one past it goes out as poison. The note was used
    up by neither, and each outage that came back so freed a later re-drive too."""
    cap = load_settings().task_max_deliveries
    sweeper = Sweeper(store, celery_sender(app), interval_seconds=1.0, stall_seconds=0.0,
                      chunk_size=10, max_deliveries=cap)  # fmt: skip
    search = create_search(store)
    for _ in range(3):  # three outages, the message back after each
        assert store.count_delivery("back-msg", 0, search.id) == 1
        store.note_outage(search.id, [0], ("back-msg", 0))
    assert store.count_delivery("back-msg", 0, search.id) == 1
    sent = []
    for _ in range(cap + 1):  # now genuine losses
        lose_oldest(store, SEARCH_QUEUE)
        assert sweeper.sweep() == []
        (redrive,) = sweeper.sweep()
        sent.append(redrive.poison)
    assert sent == [False] * cap + [True], sent


def test_a_restart_with_more_chunks_in_flight_than_the_allowance_makes_none_poison(
    store: JobStore,
) -> None:
    """A batch of 20 chunk messages, each run met by every Redis restart, each message back
    itself after it (its ack lost): at the default ``SIFT_TASK_MAX_DELIVERIES``, one outage
    more than it allows leaves every message's deliveries at 1, none poison (the economy lane
    and the prefork pool judge their items by them). The allowance of uncounted deliveries was
    one of the job's, spent by its first 10 messages in one outage; it is each message's."""
    cap = load_settings().task_max_deliveries
    batch = create_batch(store, total=200)
    messages = [f"chunk-msg-{i}" for i in range(20)]
    for _ in range(cap + 1):
        deliveries = set()
        for i, task_id in enumerate(messages):
            deliveries.add(store.count_delivery(task_id, 0, batch.id))
            store.note_outage(batch.id, range(i * 10, i * 10 + 10), (task_id, 0))
        assert deliveries == {1}, deliveries
    assert {store.count_delivery(task_id, 0, batch.id) for task_id in messages} == {1}


def test_a_lost_ingest_is_redriven_and_runs(
    store: JobStore, sweeper: Sweeper, redis_url: str, tmp_path: Path
) -> None:
    def create_ingest() -> IngestJob:
        outbox = OutboxSender(store)
        documents = [DocumentIn(id="d1", text="green tea")]
        return store.create_ingest(
            "acme",
            "docs",
            documents,
            enqueue=lambda job_id: outbox.messages([(INGEST_TASK, [job_id], INGEST_QUEUE)]),
        )

    lost = create_ingest()
    assert lose_oldest(store, INGEST_QUEUE) == Coverage(lost.id, range(0, 1))
    waiting = create_ingest()

    assert sweeper.sweep() == []  # seen lost once
    assert sweeper.sweep() == [Redrive(lost.id, "ingest", [(0, 1)], poison=False)]
    assert sorted(c.job_id for c in queued(store, INGEST_QUEUE) if c) == sorted(
        [lost.id, waiting.id]
    )
    assert sweeper.sweep() == []  # covered again: nothing more is sent

    with celery_worker(tmp_path / "w", worker_env(redis_url), "redrive"):
        for job in (lost, waiting):
            wait_until(lambda job=job: (store.get_ingest_status(job.id) or "").final, job.id)
    done = store.get_ingest(lost.id)
    assert done is not None and done.status == "succeeded" and done.upserted == 1
    assert store.get_ingest_status(waiting.id) == "succeeded"
    assert store.redis.zcard(ACTIVE_JOBS_KEY) == 0  # final jobs leave the active set


def test_one_worker_sweeps_an_interval(store: JobStore, app: Celery) -> None:
    first, second = (
        Sweeper(store, celery_sender(app), interval_seconds=30, stall_seconds=0) for _ in "ab"
    )
    second.name = "another-worker"
    assert first.sweep_if_leader() == []
    assert second.sweep_if_leader() is None
    assert first.sweep_if_leader() is None  # the lock holds for the whole interval


def test_an_economy_batch_s_lost_chunk_is_redriven_but_never_its_prepared_items(
    store: JobStore, sweeper: Sweeper
) -> None:
    """A chunk message of an economy batch lost: its items stay queued, and with them the
    whole batch (no submission starts before every item is prepared). It is re-driven as a
    standard batch's; the items other chunks prepared wait on provider batches, with no
    message of theirs, and are never re-driven; once every item is prepared, the batch
    leaves the re-drive's watch (its submission and polls have their own)."""
    batch = create_batch(store, lane="economy")
    assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))
    qids = [f"q{i:02d}" for i in range(25)]
    for _ in range(2):  # the two other chunks ran and prepared their items: acked, gone
        assert lose_oldest(store, BATCH_QUEUE) is not None
    for qid in qids[10:]:
        store.start_item(batch.id, qid)
    store.economy_save(batch.id, ECONOMY_PREPARED_KEY, {qid: "{}" for qid in qids[10:]})

    assert sweeper.sweep() == []  # seen lost once
    assert sweeper.sweep() == [Redrive(batch.id, "batch", [(0, 10)], poison=False)]
    assert [c.positions for c in queued(store, BATCH_QUEUE) if c] == [range(0, 10)]
    assert sweeper.sweep() == []  # covered again

    store.redis.delete(BATCH_QUEUE)  # the re-driven chunk ran and prepared its items
    for qid in qids[:10]:
        store.start_item(batch.id, qid)
    store.economy_save(batch.id, ECONOMY_PREPARED_KEY, {qid: "{}" for qid in qids[:10]})
    assert sweeper.sweep() == [] and sweeper.sweep() == []  # waiting on the provider: not lost
    assert store.redis.zscore(ACTIVE_JOBS_KEY, batch.id) is None  # no longer watched here


def test_the_active_set_follows_the_transitions(store: JobStore) -> None:
    result = SearchResult(hits=[], rerank=RerankInfo(applied=False))
    search = create_search(store)
    created = store.redis.zscore(ACTIVE_JOBS_KEY, search.id)
    assert created == pytest.approx(search.created_at)
    assert store.start_search(search.id)
    moved = store.redis.zscore(ACTIVE_JOBS_KEY, search.id)
    assert moved is not None and moved >= created
    assert store.finish_search(search.id, result=result)
    assert store.redis.zscore(ACTIVE_JOBS_KEY, search.id) is None

    batch = store.create_batch("acme", "docs", [("a", SearchSpec(index="docs", query="a"))])
    economy = store.create_batch(
        "acme", "docs", [("a", SearchSpec(index="docs", query="a"))], lane="economy"
    )
    assert store.pending_positions(economy.id) == [0]  # its chunk is re-driven as any batch's
    store.start_item(economy.id, "a")
    store.economy_save(economy.id, ECONOMY_PREPARED_KEY, {"a": "{}"})
    assert store.pending_positions(economy.id) == []  # prepared: it waits on a provider batch
    store.forget_active(economy.id)
    assert store.pending_positions(batch.id) == [0]
    store.start_item(batch.id, "a")
    assert store.redis.zscore(ACTIVE_JOBS_KEY, batch.id) is not None
    assert store.finish_item(batch.id, "a", result=result).batch_completed
    assert store.redis.zscore(ACTIVE_JOBS_KEY, batch.id) is None
    assert store.pending_positions(batch.id) == []

    canceled = store.create_batch("acme", "docs", [("a", SearchSpec(index="docs", query="a"))])
    assert store.cancel_batch(canceled.id) == (1, True)
    assert store.redis.zcard(ACTIVE_JOBS_KEY) == 0


# --- the urgent window: an active job's lost message, right after the event that lost it -------


@pytest.fixture
def default_sweeper(store: JobStore, app: Celery) -> Sweeper:
    """A sweeper at the default interval and stall threshold (30 s, 120 s), run by hand."""
    return sweeper_at_defaults(store, app)


def sweeper_at_defaults(store: JobStore, app: Celery) -> Sweeper:
    settings = load_settings()
    return Sweeper(
        store,
        celery_sender(app),
        interval_seconds=settings.redrive_interval_seconds,
        stall_seconds=settings.redrive_stall_seconds,
        chunk_size=10,
        max_deliveries=MAX_DELIVERIES,
    )


def reaper(store: JobStore, beats: Beats) -> Reaper:
    """The dead-worker check as a worker runs it, with the default re-drive interval, its
    beats counted on ``beats`` (:mod:`tests.integration.beats`)."""
    return Reaper(
        store.redis,
        heartbeat_seconds=BEAT,
        dead_after_seconds=2 * BEAT,
        orphan_seconds=60,
        redrive_interval_seconds=load_settings().redrive_interval_seconds,
        clock=beats,
    )


@pytest.fixture
def connection(redis_url: str) -> Iterator[Connection]:
    """A worker's kombu connection: what it takes stays unacked while it is open (closing it
    would restore them, as a clean shutdown does; a killed worker never closes it)."""
    with Connection(redis_url) as conn:
        yield conn


def take(store: JobStore, connection: Connection, queue: str, worker: str) -> Coverage | None:
    """Take the next message off ``queue`` as ``worker``'s consumer does (kombu's get without
    ack: it goes into ``unacked``), and record it as that worker's delivery."""
    target = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
    message = target(connection.default_channel).get(no_ack=False)
    assert message is not None
    store.redis.hset(DELIVERY_OWNERS_KEY, str(message.delivery_tag), worker)
    raw = store.redis.hget(KOMBU_UNACKED_KEY, str(message.delivery_tag))
    assert isinstance(raw, str)
    return coverage(json.loads(raw)[0])


def waiting_in_brpop(store: JobStore) -> list[str]:
    """The ids of the clients blocked in a ``BRPOP``: a worker's consumer waiting for a task."""
    return [c["id"] for c in store.redis.client_list() if c["cmd"] == "brpop" and "b" in c["flags"]]


def sweep_twice(sweeper: Sweeper) -> list[Redrive]:
    first = sweeper.sweep()
    return first + sweeper.sweep()


def test_an_active_batch_s_lost_chunk_is_redriven_right_after_a_dead_worker(
    store: JobStore, default_sweeper: Sweeper, connection: Connection
) -> None:
    """A worker held chunk [10, 20) and had popped [0, 10) when it was killed: the one is put
    back by the dead-worker check, the other only the re-drive can send again."""
    batch = create_batch(store)
    assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))
    assert take(store, connection, BATCH_QUEUE, "dead-worker") == Coverage(batch.id, range(10, 20))
    store.start_item(batch.id, "q10")  # the batch moved moments ago: it is not stalled

    # No event, no look: an active batch's positions are not read (the cost trade-off), so
    # its lost chunk waits for the batch to go idle.
    assert sweep_twice(default_sweeper) == []
    assert store.redis.exists(REDRIVE_SUSPECTS_KEY) == 0

    beats = Beats()
    assert check_twice(reaper(store, beats), beats) == {"dead-worker": 1}
    assert sorted(c.positions.start for c in queued(store, BATCH_QUEUE) if c) == [10, 20]
    assert default_sweeper.sweep() == []  # seen lost once
    assert default_sweeper.sweep() == [Redrive(batch.id, "batch", [(0, 10)], poison=False)]
    assert default_sweeper.sweep() == []  # covered again: sent once
    assert sorted(c.positions.start for c in queued(store, BATCH_QUEUE) if c) == [0, 10, 20]


def test_a_chunk_lost_by_a_dead_worker_goes_out_again_soon_after_it_is_found(
    store: JobStore, redis_url: str, tmp_path: Path, connection: Connection
) -> None:
    """A real worker at the defaults but for a re-drive interval longer than the test waits:
    a worker died holding one chunk (unacked, recorded as its) and with another popped and
    never recorded (its ``BRPOP``'s reply on its way at the SIGKILL). The dead-worker check
    puts the first back and opens the window; the window's own sweeps, a few seconds apart,
    send the second again, and the batch completes once. Before, the window's two sweeps
    came an interval apart each (30 s at the defaults: the lost chunk out 30 to 60 s after
    the death was found), here 300 s: the batch was not done after 120 s."""
    batch = create_batch(store, total=30)
    assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))
    assert take(store, connection, BATCH_QUEUE, "dead-worker") == Coverage(batch.id, range(10, 20))
    env = {**worker_env(redis_url), "SIFT_REDRIVE_INTERVAL_SECONDS": "300"}
    log = tmp_path / "w" / "soon.log"
    with celery_worker(tmp_path / "w", env, "soon"):
        wait_until(
            lambda: (store.get_batch(batch.id) or batch).finished_at, "batch finished", 120, log
        )
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded"
    assert done.counts == {"queued": 0, "running": 0, "succeeded": 30, "failed": 0, "canceled": 0}
    outcomes = store.batch_results(batch.id, 0, 100)
    assert [o.query_id for o in outcomes] == [f"q{i:02d}" for i in range(30)]
    text = log.read_text()
    assert "worker dead-worker found dead" in text
    assert text.count("re-driven (1 of") == 1, text[-4000:]
    assert store.redis.llen(BATCH_QUEUE) == 0


def test_covered_positions_are_never_redriven_in_the_window(
    store: JobStore, default_sweeper: Sweeper, connection: Connection
) -> None:
    """In the window every active job is read: chunks queued, one held unacked by a live worker
    (running, or waiting out a retry's countdown), a search put back by the check, and a
    queued search are all covered; only the chunk no message covers goes out again."""
    batch = create_batch(store)
    search, waiting = create_search(store), create_search(store, "coffee")
    store.redis.set(heartbeat_key("live-worker"), "1", px=60_000)
    assert take(store, connection, BATCH_QUEUE, "live-worker") == Coverage(batch.id, range(0, 10))
    store.start_item(batch.id, "q00")  # its worker is running it
    assert take(store, connection, SEARCH_QUEUE, "dead-worker") == Coverage(search.id, range(1))
    assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(10, 20))

    beats = Beats()
    assert check_twice(reaper(store, beats), beats) == {"dead-worker": 1}
    assert store.redis.pttl(REDRIVE_URGENT_KEY) > 0
    assert sweep_twice(default_sweeper) == [Redrive(batch.id, "batch", [(10, 20)], poison=False)]
    for _ in range(2):
        assert default_sweeper.sweep() == []
    assert store.redis.exists(REDRIVE_SUSPECTS_KEY) == 0
    assert store.redis.hlen(KOMBU_UNACKED_KEY) == 1  # the live worker's chunk stays its own
    assert sorted(c.positions.start for c in queued(store, BATCH_QUEUE) if c) == [10, 20]
    assert sorted(c.job_id for c in queued(store, SEARCH_QUEUE) if c) == sorted(
        [search.id, waiting.id]
    )


def test_a_redis_restart_opens_the_window(tmp_path: Path) -> None:
    """redis-server stopped and started again on its AOF after a pop whose reply it cut off:
    the next two sweeps find the restart and re-drive the active batch's lost chunk."""
    with broker(tmp_path / "redis") as running:
        store = JobStore.from_url(running.url + "/0")
        app = create_celery_app(load_settings(redis_url=running.url + "/0"))
        try:
            sweeper = sweeper_at_defaults(store, app)
            batch = create_batch(store)
            assert sweeper.sweep() == []  # the run_id it started with is stored
            assert lose_oldest(store, BATCH_QUEUE) == Coverage(batch.id, range(0, 10))
            assert sweeper.sweep() == []  # active, not stalled: not looked at

            running.kill(signal.SIGTERM)
            running.start_again()
            store.start_item(batch.id, "q10")  # the batch goes on moving

            assert sweeper.sweep() == []  # the restart seen, the chunk seen lost once
            assert store.redis.pttl(REDRIVE_URGENT_KEY) > 0
            assert sweeper.sweep() == [Redrive(batch.id, "batch", [(0, 10)], poison=False)]
            assert sweeper.sweep() == []
            assert sorted(c.positions.start for c in queued(store, BATCH_QUEUE) if c) == [0, 10, 20]
        finally:
            app.close()
            store.close()


def test_a_worker_s_broker_reconnect_opens_the_window(
    store: JobStore, redis_url: str, tmp_path: Path
) -> None:
    """A connection that breaks while Redis stays up (no new run_id to see): the worker's
    consumer, started again on a new connection, opens the window itself.

    The connections are killed once the consumer waits in a ``BRPOP``, the reply the window
    is for. Killed before its first one (the worker is "ready" a moment earlier, longer on a
    loaded machine), the connection is idle in redis-py's pool, which replaces it unseen when
    the consumer takes it: no reply was cut off, no reconnect, no window (the test failed so)."""
    env = {**worker_env(redis_url), "SIFT_REDRIVE_INTERVAL_SECONDS": "30"}  # the default
    log = tmp_path / "w" / "reconnect.log"
    with celery_worker(tmp_path / "w", env, "reconnect", concurrency=2):
        wait_until(lambda: waiting_in_brpop(store), "the consumer waiting in BRPOP", log=log)
        assert not store.redis.exists(REDRIVE_URGENT_KEY)  # a first start opens nothing
        store.redis.client_kill_filter(_type="normal", skipme=True)
        wait_until(lambda: store.redis.exists(REDRIVE_URGENT_KEY), "the window opened", log=log)
        search = create_search(store)  # and the worker goes on consuming
        wait_until(
            lambda: store.get_search_status(search.id) == "succeeded", "search done", log=log
        )
    assert (
        store.redis.get(REDRIVE_URGENT_KEY) == "this worker's broker connection dropped and is back"
    )
    assert 0 < store.redis.pttl(REDRIVE_URGENT_KEY) <= 75_000


def test_a_lost_webhook_sent_again_is_counted_as_a_webhook(store: JobStore, app: Celery) -> None:
    """``sift_redriven_total{kind="webhook"}`` counts a webhook the sweep sends again, as
    docs/queue.md says (it was recorded as ``kind="other"``)."""
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"), webhook_url=HOOK)
    assert store.start_search(job.id) and store.finish_search(job.id, result=RESULT)
    sweeper = Sweeper(store, celery_sender(app), interval_seconds=30, stall_seconds=120)
    before = REGISTRY.get_sample_value("sift_redriven_total", {"kind": "webhook"}) or 0.0
    assert sweeper.resend_webhooks(now=time.time() + 1601) == [job.id]
    after = REGISTRY.get_sample_value("sift_redriven_total", {"kind": "webhook"}) or 0.0
    assert after - before == 1


def webhook_sweeper(store: JobStore, sent: list[str]) -> Sweeper:
    """A sweeper at the default grace whose sends are only recorded (job ids)."""
    return Sweeper(
        store,
        lambda name, args, queue, task_id: sent.append(args[0]["data"]["id"]),
        interval_seconds=30,
        stall_seconds=120,
        webhook_grace_seconds=1600,
    )


def waiting_and_lost_webhooks(store: JobStore, app: Celery) -> tuple[SearchJob, SearchJob]:
    """Two finished searches that owe a webhook: the first's message waits in its queue,
    the second's was never published (its worker died)."""
    waiting, lost = (
        store.create_search("acme", SearchSpec(index="docs", query=q), webhook_url=HOOK)
        for q in ("tea", "coffee")
    )
    for job in (waiting, lost):
        assert store.start_search(job.id) and store.finish_search(job.id, result=RESULT)
    event = webhook_event(WEBHOOK_EVENT_SEARCH_COMPLETED, waiting.id, "acme", HOOK, "succeeded")
    celery_sender(app)(WEBHOOK_TASK, [event], WEBHOOK_QUEUE, "a-live-message")
    return waiting, lost


def test_an_overdue_webhook_still_in_the_broker_is_not_sent_again(
    store: JobStore, app: Celery, connection: Connection
) -> None:
    """A webhook whose message waits past the grace (behind a backlog, or held unacked by a
    worker: the webhook workers stopped, say) is live: the sweep leaves it, and looks again a
    grace later. One with no message left (never published here: its worker died) is sent
    again, once a sweep, never a copy of one still waiting."""
    waiting, lost = waiting_and_lost_webhooks(store, app)
    sent: list[str] = []
    sweeper = webhook_sweeper(store, sent)
    later = time.time() + 1601
    assert sweeper.resend_webhooks(now=later) == [lost.id]  # not the one in its queue
    take(store, connection, WEBHOOK_QUEUE, "w1")  # now held unacked by a worker
    assert sweeper.resend_webhooks(now=later + 1) == []  # both due again a grace later
    assert sweeper.resend_webhooks(now=later + 1602) == [lost.id]
    assert sent == [lost.id, lost.id]
    assert store.redis.zscore(WEBHOOKS_OWED_KEY, waiting.id) == pytest.approx(later + 1602)


def test_a_webhook_settled_while_the_sweep_looks_is_not_sent_again(
    store: JobStore, app: Celery
) -> None:
    """A late delivery that ends (settles its webhook, then is acked) between the sweep's
    read of what is overdue and its read of the broker leaves no message and no debt: it
    is not sent again (it was: the sweep sent what it had read as overdue)."""
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"), webhook_url=HOOK)
    assert store.start_search(job.id) and store.finish_search(job.id, result=RESULT)
    sent: list[str] = []

    class Racing(Sweeper):
        def _waiting_webhooks(self, job_ids: set[str]) -> set[str]:
            # the delivery ended meanwhile, its message acked
            store.webhook_settled(job.id, "delivered", 1)
            return super()._waiting_webhooks(job_ids)

    sweeper = Racing(
        store,
        lambda name, args, queue, task_id: sent.append(args[0]["data"]["id"]),
        interval_seconds=30,
        stall_seconds=120,
    )
    assert sweeper.resend_webhooks(now=time.time() + 1601) == []
    assert sent == [] and store.redis.zcard(WEBHOOKS_OWED_KEY) == 0


def test_a_lost_webhook_goes_out_again_on_the_window_s_second_sweep(
    store: JobStore, app: Celery
) -> None:
    """In an urgent window, an owed webhook already due with no message in the broker on two
    sweeps in a row, at the same due time, is sent again then, not a grace (1,600 s) later;
    one whose message waits in its queue is not (it waited out the grace)."""
    _waiting, lost = waiting_and_lost_webhooks(store, app)
    store.redis.set(REDRIVE_URGENT_KEY, "a worker died", px=75_000)
    sent: list[str] = []
    sweeper = webhook_sweeper(store, sent)
    now = time.time() + 1
    assert sweeper.resend_webhooks(now=now) == []  # one sweep's look is no proof
    assert store.redis.hkeys(REDRIVE_WEBHOOK_SUSPECTS_KEY) == [lost.id]
    assert sweeper.resend_webhooks(now=now + 5) == [lost.id]
    assert sweeper.resend_webhooks(now=now + 10) == []  # due again at its re-send
    assert sent == [lost.id]


def test_a_webhook_whose_due_time_moved_between_the_window_s_sweeps_is_not_sent_again(
    store: JobStore,
) -> None:
    """A webhook whose due time changed between two sweeps (a retry recorded meanwhile) was
    not lost between them: it is sent again only once two sweeps agree on its new one."""
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"), webhook_url=HOOK)
    assert store.start_search(job.id) and store.finish_search(job.id, result=RESULT)
    store.redis.set(REDRIVE_URGENT_KEY, "a worker died", px=75_000)
    sent: list[str] = []
    sweeper = webhook_sweeper(store, sent)
    now = time.time() + 1
    assert sweeper.resend_webhooks(now=now) == []
    assert store.webhook_due(job.id, now + 1, 2)  # its retry, due before the next sweep
    assert sweeper.resend_webhooks(now=now + 5) == []
    assert sweeper.resend_webhooks(now=now + 10) == [job.id]
    assert sent == [job.id]


def test_outside_the_window_a_lost_webhook_waits_out_the_grace(store: JobStore) -> None:
    """With no urgent window open, an owed webhook with no message is sent again only once it
    is overdue by the grace, however many sweeps saw it lost before."""
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"), webhook_url=HOOK)
    assert store.start_search(job.id) and store.finish_search(job.id, result=RESULT)
    sent: list[str] = []
    sweeper = webhook_sweeper(store, sent)
    now = time.time() + 1
    assert sweeper.resend_webhooks(now=now) == []
    assert sweeper.resend_webhooks(now=now + 5) == []
    assert store.redis.exists(REDRIVE_WEBHOOK_SUSPECTS_KEY) == 0
    assert sweeper.resend_webhooks(now=now + 1600) == [job.id]
    assert sent == [job.id]


def test_a_window_s_sweep_that_finds_a_webhook_lost_brings_the_next_sweep_soon(
    store: JobStore, default_sweeper: Sweeper
) -> None:
    """The sweep confirming a webhook seen lost comes within 5 s, not an interval (30 s) on,
    as for chunks."""
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"), webhook_url=HOOK)
    assert store.start_search(job.id) and store.finish_search(job.id, result=RESULT)
    store.redis.set(REDRIVE_URGENT_KEY, "a worker died", px=75_000)
    assert default_sweeper.sweep_if_leader() == []
    assert store.redis.hkeys(REDRIVE_WEBHOOK_SUSPECTS_KEY) == [job.id]
    assert 0 < store.redis.pttl(REDRIVE_LEADER_KEY) <= 5_000


def test_a_user_that_may_not_run_info_still_redrives_a_lost_search(
    store: JobStore, redis_url: str, tmp_path: Path
) -> None:
    """A Redis whose ACL refuses ``INFO`` (a managed service's user, as Redis Cloud's "not
    dangerous" role): the sweep's restart check cannot read the ``run_id``, and every sweep
    failed on it before re-driving anything, so a search whose message was lost stayed
    ``queued``. A real worker on that user re-drives it to its end."""
    store.redis.execute_command(
        "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info"
    )
    try:
        lost = create_search(store)
        assert lose_oldest(store, SEARCH_QUEUE) == Coverage(lost.id, range(0, 1))
        host = redis_url.removeprefix("redis://")
        env = {
            **worker_env(f"redis://noinfo:pw@{host}"),
            "SIFT_REDRIVE_INTERVAL_SECONDS": "1",  # sooner than the defaults, as bad
            "SIFT_REDRIVE_STALL_SECONDS": "0",
        }
        with celery_worker(tmp_path / "w", env, "noinfo"):
            log = tmp_path / "w" / "noinfo.log"
            wait_until(lambda: (store.get_search_status(lost.id) or "").final, lost.id, log=log)
        assert store.get_search_status(lost.id) == "succeeded"
        said = log.read_text(errors="replace")
        assert "re-drive sweep failed" not in said, said[-4000:]
        assert said.count("re-drive: this Redis user may not run INFO") == 1, said[
            -4000:
        ]  # said once, what it costs
    finally:
        store.redis.execute_command("ACL", "DELUSER", "noinfo")
