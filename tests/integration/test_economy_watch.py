"""The economy lane's watch against a real redis-server: a submission or poll whose message
was lost is sent again by the re-drive's sweep, once per margin, and never for a finished
batch (:func:`worker.queue.economy.rewake`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from worker import clock
from worker.clock import SharedClock
from worker.constants import (
    BATCH_QUEUE,
    ECONOMY_LEASE_KEY,
    ECONOMY_POLL_TASK,
    ECONOMY_SUBMIT_TASK,
    WORKER_HEARTBEAT_KEY,
)
from worker.contract import RerankInfo, SearchResult, SearchSpec
from worker.queue import liveness
from worker.queue.base import WorkerContext
from worker.queue.economy import WATCH_MARGIN_SECONDS, leases, rewake
from worker.queue.jobstore import JobStore
from worker.queue.redrive import Sweeper
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings


def _economy_batch(store: JobStore) -> str:
    spec = SearchSpec(index="docs", query="q")
    batch = store.create_batch("acme", "docs", [("q0", spec)], lane="economy")
    store.start_item(batch.id, "q0")
    return batch.id


def _redriven(kind: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sift_redriven_total", {"kind": kind}) or 0.0


def test_a_lost_poll_or_submission_is_sent_again_once_it_is_overdue(store: JobStore) -> None:
    """And counted in ``sift_redriven_total``, whose "above zero is a crash that would have
    lost work" it is: a poll lost with a Redis restart was sent again with the counter at 0."""
    batch_id = _economy_batch(store)
    before = _redriven("economy")
    now = time.time()
    store.economy_expect(batch_id, "msgbatch_lost", now - 1)  # due, never ran: lost
    store.economy_expect(batch_id, "submit", now - 1)
    store.economy_expect(batch_id, "msgbatch_waiting", now + 60)  # its poll is not due yet
    sent: list[tuple[str, list[Any], str]] = []
    sweeper = Sweeper(store, lambda name, args, queue, task_id: sent.append((name, args, queue)),
                      interval_seconds=30, stall_seconds=120)  # fmt: skip
    sweeper.sweep()
    assert sorted(sent) == [
        (ECONOMY_POLL_TASK, [batch_id, "msgbatch_lost"], BATCH_QUEUE),
        (ECONOMY_SUBMIT_TASK, [batch_id], BATCH_QUEUE),
    ]
    assert _redriven("economy") - before == 2
    # sent once: due again a margin later, not at every sweep
    assert store.economy_overdue(now + 1) == []
    assert len(store.economy_overdue(now + WATCH_MARGIN_SECONDS + 61)) == 3


def test_a_finished_batch_is_never_woken(store: JobStore) -> None:
    batch_id = _economy_batch(store)
    store.finish_item(
        batch_id, "q0", result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
    )
    store.economy_expect(batch_id, "msgbatch_done", time.time() - 1)
    sent: list[str] = []
    before = _redriven("economy")
    assert rewake(store, lambda name, *_: sent.append(name), time.time()) == 0
    assert _redriven("economy") == before
    assert sent == [] and store.economy_overdue(time.time()) == []  # and forgotten


def test_one_run_of_an_economy_task_holds_its_lease_while_its_worker_lives(
    store: JobStore,
) -> None:
    """Two runs of one economy task (the same message delivered again, or a re-send while
    the first still runs): the second stands down while the first's worker beats; a dead
    worker's lease is taken over; only its holder gives a lease back."""
    batch_id = _economy_batch(store)
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    assert store.economy_lease(batch_id, "submit", "w1 run-a", 300)
    assert not store.economy_lease(batch_id, "submit", "w2 run-b", 300)  # w1 lives
    assert store.economy_lease(batch_id, "submit", "w1 run-a", 300)  # its own: renewed
    assert store.economy_lease(batch_id, "msgbatch_x", "w2 run-c", 300)  # another task's
    store.economy_unlease(batch_id, "submit", "w2 run-b")  # not the holder: nothing
    assert not store.economy_lease(batch_id, "submit", "w2 run-b", 300)
    store.redis.delete(WORKER_HEARTBEAT_KEY + "w1")  # w1 died
    store.redis.set(WORKER_HEARTBEAT_KEY + "w2", "1", px=60_000)
    assert store.economy_lease(batch_id, "submit", "w2 run-b", 300)  # taken over
    assert not store.economy_lease(batch_id, "submit", "w1 run-a", 300)  # fenced: stops
    store.economy_unlease(batch_id, "submit", "w2 run-b")
    # the stale run finds it free, and still may not take it again where it stopped
    assert not store.economy_lease(batch_id, "submit", "w1 run-a", 300, renew=True)
    assert store.economy_lease(batch_id, "submit", "w3 run-d", 300)  # free again


def test_a_lease_that_ran_out_while_redis_was_away_is_kept_by_its_run(store: JobStore) -> None:
    """Redis away past a lease's term (restarted from its append-only file, the lease's key
    expired on load) while its run goes on: no run took it since, so the run's next renewal
    keeps it. Before, the renewal found it gone and the run stood down, and its work waited
    for the watch to send it again, minutes later. The process's keeper thread, which may
    race the run giving its lease back, only keeps a lease still held."""
    batch_id = _economy_batch(store)
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    assert store.economy_lease(batch_id, "submit", "w1 run-a", 10)
    store.redis.delete(ECONOMY_LEASE_KEY + f"{batch_id} submit")  # ran out meanwhile
    # the keeper's renewal only keeps a lease held (it may race the run giving it back)
    assert not store.economy_lease(batch_id, "submit", "w1 run-a", 10, renew=True)
    # the run's own next step takes it again and goes on
    assert store.economy_lease(batch_id, "submit", "w1 run-a", 10, renew=True, resume=True)
    assert not store.economy_lease(batch_id, "submit", "w2 run-b", 10)  # held again
    # taken by another run since (its run ended and gave it back): not the stale run's
    store.redis.delete(WORKER_HEARTBEAT_KEY + "w1")
    store.redis.delete(ECONOMY_LEASE_KEY + f"{batch_id} submit")
    assert store.economy_lease(batch_id, "submit", "w2 run-b", 10)
    store.economy_unlease(batch_id, "submit", "w2 run-b")
    assert not store.economy_lease(batch_id, "submit", "w1 run-a", 10, renew=True, resume=True)


# A prefork child of worker "w1": it takes the submission's lease and holds it, running.
_CHILD = """
import sys, time
from types import SimpleNamespace
from worker.queue import liveness
from worker.queue.economy import leases
from worker.queue.base import WorkerContext
from worker.queue.jobstore import JobStore
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

url, batch_id = sys.argv[1], sys.argv[2]
liveness.current = lambda: SimpleNamespace(worker_id="w1")
store = JobStore.from_url(url)
context = WorkerContext(settings=load_settings(redis_url=url), store=store,
                        limiter=ProviderLimiter(1))

def hold():
    print("holding", flush=True)
    time.sleep(600)

leases.leased(SimpleNamespace(context=context), batch_id, "submit", hold)
"""


def test_a_run_whose_process_died_alone_lets_the_next_run_take_its_lease(
    store: JobStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the prefork pool a worker's children share its heartbeat. A child's run holds
    the submission's lease: while the child lives, another run (its message delivered
    again) waits and stands down, however long the run goes on. The child killed alone, its
    worker beating on, the redelivered run takes the lease over within the time a lease
    lives unrenewed, not once its 300 s term ran out (while the watch's re-send waited)."""
    batch_id = _economy_batch(store)
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=600_000)  # the supervisor beats on
    monkeypatch.setattr(liveness, "current", lambda: SimpleNamespace(worker_id="w1"))
    settings = load_settings(redis_url=redis_url)
    context = WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(1))
    task = SimpleNamespace(context=context)  # another child of the same worker
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD, redis_url, batch_id], stdout=subprocess.PIPE
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == b"holding"
            ran: list[str] = []
            leases.leased(task, batch_id, "submit", lambda: ran.append("beside it"))  # type: ignore[arg-type]
            assert ran == []  # it waited past a lease's unrenewed life: the child keeps it
            child.kill()
            child.wait(10)
            leases.leased(task, batch_id, "submit", lambda: ran.append("after it"))  # type: ignore[arg-type]
            assert ran == ["after it"]
        finally:
            child.kill()


def test_a_sweeper_whose_clock_is_ahead_leaves_a_poll_on_its_way(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll expected by a worker with a true clock (its countdown 30 s, the default first
    poll, plus the margin) is not judged lost by a re-drive sweep on a host whose clock is 6
    minutes ahead: both read the shared clock (Redis's, :mod:`worker.clock`), as their
    liveness beats make it. Before, the sweep passed its host's ``time.time()``: the poll
    was sent again as lost (counted in ``sift_redriven_total``, a warning), and the message
    really on its way was superseded."""
    shared = SharedClock()
    shared.read(store.redis.time)
    monkeypatch.setattr(clock, "CLOCK", shared)
    batch_id = _economy_batch(store)
    store.economy_hand_over(batch_id, "msgbatch_1", "eco-live")  # the poll on its way
    context = WorkerContext(
        settings=load_settings(redis_url="redis://unused"), store=store, limiter=ProviderLimiter(1)
    )
    leases.expect(SimpleNamespace(context=context), batch_id, "msgbatch_1", 30.0)  # type: ignore[arg-type]
    true_time = time.time
    monkeypatch.setattr(time, "time", lambda: true_time() + 360)  # the sweeper's host
    sent: list[str] = []
    sweeper = Sweeper(store, lambda name, args, queue, task_id: sent.append(task_id),
                      interval_seconds=30, stall_seconds=120)  # fmt: skip
    assert sweeper.rewake_economy() == 0
    monkeypatch.setattr(time, "time", true_time)
    assert sent == []
    assert store.economy_take(batch_id, "msgbatch_1", "eco-live")  # the live poll still runs


def test_a_wall_clock_stepped_on_lets_no_live_run_s_lease_lapse(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper lets go of a run stuck past its watch's margin since its last mark, and
    measures that on the monotonic clock: a wall clock stepped on by more than the margin
    (an NTP correction, a VM resumed) leaves a run that has just marked its lease. Before,
    it measured on the wall clock, and every live run's lease was let go at the step."""
    batch_id = _economy_batch(store)
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    lease = (batch_id, "submit", "w1 run-a")
    assert store.economy_lease(batch_id, "submit", "w1 run-a", 10)
    keeper = leases._Keeper()
    keeper.pid = os.getpid()  # no thread of its own: the test renews by hand
    context = WorkerContext(
        settings=load_settings(redis_url="redis://unused"), store=store, limiter=ProviderLimiter(1)
    )
    keeper.keep(SimpleNamespace(context=context), lease)  # type: ignore[arg-type]
    true_time = time.time
    monkeypatch.setattr(time, "time", lambda: true_time() + WATCH_MARGIN_SECONDS + 60)
    keeper.renew()
    monkeypatch.setattr(time, "time", true_time)
    assert lease in keeper.held
    assert not store.economy_lease(batch_id, "submit", "w2 run-b", 10)  # still the run's
