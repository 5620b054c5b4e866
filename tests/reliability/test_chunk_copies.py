"""A running batch chunk's message put back by a broker reconnect, on the real stack
(redis-server, real Celery workers, the gateway): the copy is no delivery, and fails nothing.

Worker A runs the batch's one chunk one item at a time (``SIFT_BATCH_ITEM_CONCURRENCY=1``):
its first item is held in its query's embedding, the others wait in A's item queue (and A
stops reading the batch queue meanwhile). Worker B starts, then every worker's broker
connection is killed (CLIENT KILL; Redis stays up): kombu's close puts A's running chunk
message back, and a worker takes it again while A's run goes on. With
``SIFT_TASK_MAX_DELIVERIES=1``, a copy counted as a delivery is poison.

The copy is refused by the chunk's run claim before its delivery is counted: the message's
counter stays at 1, and A's run finishes every item. Before, the copy counted a second
delivery, and past the limit failed ``delivery_limit_exceeded`` the items A's run had not
reached yet (those no run held): the batch completed with them failed though nothing was
lost.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import redis

from tests.reliability.support import ACME, INDEX, batch_counts, wait_for
from tests.reliability.test_ingest_crashes import (
    KEPT,
    Crash,
    final,
    own_crash_stack,
    upsert,
    worker,
)
from worker.constants import ATTEMPTS_KEY, BATCH_QUEUE, KOMBU_UNACKED_KEY
from worker.queue.jobstore import JobStore
from worker.queue.redrive import Sweeper

pytestmark = pytest.mark.integration

QUERIES = [
    "hold-embedding calcium and bone density",
    "calcium intake in adults",
    "bone density after fifty",
    "vitamin d and calcium",
]


def _a_chunk_held_on(crash: Crash, log: Path) -> tuple[str, str]:
    """A batch of ``QUERIES`` sent to the one worker running (its log ``log``), its chunk's
    first item held in its query's embedding and the worker's intake paused: the batch's id
    and the chunk task's id (the one running: a readiness check's batches have run too)."""
    assert final(crash.client, upsert(crash.client, KEPT))["status"] == "succeeded"
    body = {"index": INDEX, "queries": [{"id": f"q{i}", "query": q} for i, q in enumerate(QUERIES)]}
    response = crash.client.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    held = crash.directory / "crashes" / "hold-embedding"
    wait_for(held.exists, "the chunk's first item, held in its query's embedding")
    wait_for(lambda: "stopped reading sift.batch" in log.read_text(), "the intake paused")
    text = log.read_text()
    (task_id,) = [
        found
        for found in re.findall(r"Task sift\.batch_chunk\[([0-9a-f-]+)\] received", text)
        if f"Task sift.batch_chunk[{found}] succeeded" not in text
    ]
    return str(response.json()["id"]), task_id


@pytest.mark.timeout(300)
def test_a_running_chunk_s_copy_put_back_by_a_reconnect_counts_and_fails_nothing(
    tmp_path: Path,
) -> None:
    with (
        own_crash_stack(tmp_path) as crash,
        redis.Redis.from_url(crash.env["SIFT_REDIS_URL"]) as raw,
    ):
        crash.env["SIFT_BATCH_ITEM_CONCURRENCY"] = "1"  # A's other items wait for the held one
        crash.env["SIFT_TASK_MAX_DELIVERIES"] = "1"  # a copy counted is poison
        logs = [crash.directory / "w" / f"{name}.log" for name in ("a", "b")]
        with worker(crash, "a") as proc_a:
            batch_id, task_id = _a_chunk_held_on(crash, logs[0])
            started = batch_counts(crash.client, batch_id)
            assert started["counts"]["running"] == 1, started
            counter = f"{ATTEMPTS_KEY}{task_id}:0"
            with worker(crash, "b") as proc_b:
                wait_for(lambda: logs[1].exists() and "ready" in logs[1].read_text(), "B ready")
                raw.client_kill_filter(_type="normal", skipme=True)  # the workers' too
                received = f"Task sift.batch_chunk[{task_id}] received"
                copy_done = f"Task sift.batch_chunk[{task_id}] succeeded"  # A's run is held

                def text() -> str:
                    return "".join(log.read_text(errors="replace") for log in logs)

                wait_for(
                    lambda: (
                        text().count(received) == 2
                        and not raw.llen(BATCH_QUEUE)
                        and not raw.hlen(KOMBU_UNACKED_KEY)  # the copy taken and acked
                        # (a copy counted, and run on A, waits behind A's held item)
                        and (copy_done in text() or raw.get(counter) != b"1")
                    ),
                    "the copy delivered and done",
                )
                deliveries = raw.get(counter)
                (crash.directory / "crashes" / "release").touch()
                wait_for(
                    lambda: batch_counts(crash.client, batch_id)["status"] != "running",
                    "the batch's end",
                )
                ended = batch_counts(crash.client, batch_id)
                assert proc_a.poll() is None and proc_b.poll() is None  # both still running
    assert ended["status"] == "succeeded", ended
    assert ended["counts"]["succeeded"] == len(QUERIES), ended["counts"]  # none failed
    assert deliveries == b"1", deliveries  # A's run's only: the copy counted none


@pytest.mark.timeout(600)
def test_a_chunk_handed_back_after_its_copy_was_refused_goes_back_on_its_queue(
    tmp_path: Path,
) -> None:
    """The copy kombu's close made of A's running chunk is refused by the chunk's claim and
    acked: the run's own message went with it (the copy had its delivery tag). A is then
    SIGTERMed (a rolling restart after a Redis blip): it hands its chunk back, its four items:
    the three not started and the one held in its embedding, stopped before its model call
    (it ran to its end there before, and the chunk went back with three). The hand-back puts
    the chunk back on its queue, the same message (its task id), and B takes it at once.
    Before, its ``Reject(requeue=True)`` found no message in ``unacked`` to put back and put
    nothing: the three items were left ``queued`` with no
    message, until the re-drive found them lost (once the batch had been idle 120 s at the
    defaults, or in a reconnect's urgent window)."""
    with (
        own_crash_stack(tmp_path) as crash,
        redis.Redis.from_url(crash.env["SIFT_REDIS_URL"]) as raw,
    ):
        crash.env["SIFT_BATCH_ITEM_CONCURRENCY"] = "1"  # A's other items wait for the held one
        logs = [crash.directory / "w" / f"{name}.log" for name in ("a", "b")]

        def text() -> str:
            return "".join(log.read_text(errors="replace") for log in logs if log.exists())

        with worker(crash, "a") as proc_a:
            batch_id, task_id = _a_chunk_held_on(crash, logs[0])
            received = f"Task sift.batch_chunk[{task_id}] received"
            with worker(crash, "b") as proc_b:
                wait_for(lambda: logs[1].exists() and "ready" in logs[1].read_text(), "B ready")
                raw.client_kill_filter(_type="normal", skipme=True)  # the workers' too
                wait_for(
                    lambda: (
                        text().count(received) == 2
                        and "another run holds chunk" in text()
                        and not raw.llen(BATCH_QUEUE)
                        and not raw.hlen(KOMBU_UNACKED_KEY)  # the copy taken, refused, acked
                    ),
                    "the copy refused and acked",
                )
                proc_a.send_signal(signal.SIGTERM)
                wait_for(lambda: "Warm shutdown" in logs[0].read_text(), "A stopping")
                (crash.directory / "crashes" / "release").touch()
                proc_a.wait(60)
                assert "4 items handed back" in logs[0].read_text()
                with redis.Redis.from_url(crash.env["SIFT_REDIS_URL"], decode_responses=True) as r:
                    sweeper = Sweeper(
                        JobStore(r), lambda *_: None, interval_seconds=30, stall_seconds=120
                    )
                    lost = sweeper.lost_positions(urgent=True)  # what no message covers now
                wait_for(
                    # (queued while B has not started them: every item went back queued)
                    lambda: (
                        batch_counts(crash.client, batch_id)["status"] not in ("queued", "running")
                    ),
                    "the batch's end",
                    400,
                )
                ended = batch_counts(crash.client, batch_id)
                assert proc_b.poll() is None
                retaken = logs[1].read_text().count(received)
    assert lost == {}, lost  # the four items handed back: their message gone
    assert ended["status"] == "succeeded", ended
    assert ended["counts"]["succeeded"] == len(QUERIES), ended["counts"]
    assert text().count(received) == 3, retaken  # A's, the copy, and the hand-back's, on B
