"""The economy lane when a poll's message is lost or late after its worker was SIGKILLed,
at default settings (the stack of :mod:`tests.reliability.economy`).

- killed while its poll waits out its countdown, and that poll's message then lost (taken
  out of the broker, as kombu's pop-then-record window loses one): the new worker's re-drive
  sweep sends the poll again once it is overdue, and the batch finishes;
- the same, but the message only late: the sweep's new poll and the late one never both go
  on polling;
- (a chunk message lost: test_economy_lost_chunk.py; a submission's slow create delivered
  again or taken over: test_economy_slow_create.py)
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.economy import FINISH_WINDOW, economy_stack, finished, submit_economy, worker
from tests.reliability.support import assert_batch_exactly_once, ingest, wait_for
from worker.constants import (
    ECONOMY_POLL_TASK,
    ECONOMY_WATCH_KEY,
    KOMBU_UNACKED_INDEX_KEY,
    KOMBU_UNACKED_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.queue.economy import SUBMIT_CLAIM

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _polls_held(client: redis.Redis) -> int:
    """The economy poll messages a worker holds (unacked): the watch's entry is written just
    before its message is published, so a worker killed on seeing the entry may not have
    published it yet."""
    return sum(
        1
        for raw in client.hvals(KOMBU_UNACKED_KEY)
        if json.loads(raw)[0]["headers"]["task"] == ECONOMY_POLL_TASK
    )


def _submission_over(client: redis.Redis, batch_id: str) -> bool:
    """Whether the batch's submission ran to its end (it leaves the watch last, once its
    items' runs name their provider batch). A worker killed before that leaves it to be
    delivered again, and that run settles the create and sends a poll of its own (a new
    due time on the watch, over the one a test set): no sweep would then send one again."""
    return client.zscore(ECONOMY_WATCH_KEY, f"{batch_id} {SUBMIT_CLAIM}") is None


def _lose_polls(client: redis.Redis) -> int:
    """Take every economy poll message out of the broker (unacked and queued): lost."""
    lost = 0
    for tag, raw in client.hgetall(KOMBU_UNACKED_KEY).items():
        if json.loads(raw)[0]["headers"]["task"] == ECONOMY_POLL_TASK:
            client.hdel(KOMBU_UNACKED_KEY, tag)
            client.zrem(KOMBU_UNACKED_INDEX_KEY, tag)
            lost += 1
    for queue in client.keys("sift.*"):
        if client.type(queue) != "list":
            continue
        for raw in client.lrange(queue, 0, -1):
            if json.loads(raw)["headers"]["task"] == ECONOMY_POLL_TASK:
                lost += client.lrem(queue, 0, raw)
    return lost


def test_a_lost_poll_message_is_sent_again_by_the_sweep(tmp_path: Path) -> None:
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        model.configure(batch_processing_seconds=5.0)
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)

        def watched() -> list[str]:
            return list(broker.zrange(ECONOMY_WATCH_KEY, 0, -1))

        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 5)
            wait_for(lambda: len(model.batches()) == 1, "the provider batch made", 120)
            [provider] = [b["id"] for b in model.batches()]
            wait_for(lambda: f"{batch_id} {provider}" in watched(), "its poll scheduled", 30)
            wait_for(lambda: _polls_held(broker) == 1, "its poll message held", 30)
            wait_for(lambda: _submission_over(broker, batch_id), "the submission over", 30)
            worker_a.send_signal(signal.SIGKILL)  # holding the poll, waiting out its 30 s
            worker_a.wait(10)
        assert _lose_polls(broker) == 1
        _wait_heartbeats_gone(broker)
        # time passing: the poll's due time (30 s + the 300 s margin) is now
        broker.zadd(ECONOMY_WATCH_KEY, {f"{batch_id} {provider}": 0})
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        log = (tmp_path / "w" / "b.log").read_text(errors="replace")
        assert f"its {provider} task did not run when due; sent again" in log
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 5)
        assert len(model.batches()) == 1
        assert [m for m in watched() if m.startswith(batch_id)] == []


def _wait_heartbeats_gone(client: redis.Redis) -> None:
    """Wait until the killed worker's heartbeat has lapsed (its dead-worker TTL, 10 s at the
    defaults), as it has long before a poll's due time (30 s and the 300 s margin) passes:
    the test makes that time pass at once, and a sweep run in those seconds sent a poll
    that found the lease still held by a live-looking worker, stood down, and left no poll
    going for the late message to race."""
    gone = "the killed worker's heartbeat gone"
    wait_for(lambda: not client.keys(WORKER_HEARTBEAT_KEY + "*"), gone, 60)


def _take_polls(client: redis.Redis) -> list[str]:
    """Take the economy poll messages out of the broker, answering them (as queued): each
    held up somewhere, as behind a long backlog of the batch queue, to come back later."""
    taken: list[str] = []
    for tag, raw in client.hgetall(KOMBU_UNACKED_KEY).items():
        message = json.loads(raw)[0]
        if message["headers"]["task"] == ECONOMY_POLL_TASK:
            client.hdel(KOMBU_UNACKED_KEY, tag)
            client.zrem(KOMBU_UNACKED_INDEX_KEY, tag)
            taken.append(json.dumps(message))
    return taken


def test_a_poll_sent_again_while_its_late_message_comes_back_keeps_one_poll_going(
    tmp_path: Path,
) -> None:
    # A poll's message late past its due time (the worker killed while holding it and back
    # after a long outage; a backlog of the batch queue before it) but not lost: the sweep
    # sends it again, then the late message runs too. Only one of them may go on polling:
    # two would each retry for as long as the provider batch runs, and each map its results
    # (an errored line resubmitted twice: a second provider batch, paid twice).
    # The provider batch stays in_progress until the late message has run (so it, too, finds
    # the batch going and would poll on), then ends: the polls run at the default cadence
    # throughout, and the test no longer waits out a fixed 150 s batch and the backoff
    # around it (it took 255 s of the CI).
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        model.configure(batch_processing_seconds=3600.0)
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 5)
            wait_for(lambda: len(model.batches()) == 1, "the provider batch made", 120)
            [provider] = [b["id"] for b in model.batches()]
            member = f"{batch_id} {provider}"
            wait_for(lambda: broker.zscore(ECONOMY_WATCH_KEY, member) is not None, "its poll", 30)
            wait_for(lambda: _polls_held(broker) == 1, "its poll message held", 30)
            wait_for(lambda: _submission_over(broker, batch_id), "the submission over", 30)
            worker_a.send_signal(signal.SIGKILL)  # holding the poll, waiting out its 30 s
            worker_a.wait(10)
        [late] = _take_polls(broker)
        _wait_heartbeats_gone(broker)
        broker.zadd(ECONOMY_WATCH_KEY, {member: 0})  # its due time passed
        log_b = tmp_path / "w" / "b.log"
        with worker(tmp_path / "w", env, "b"):
            wait_for(
                lambda: "did not run when due; sent again" in log_b.read_text(errors="replace"),
                "the sweep's new poll",
                120,
            )
            # the sweep's log line says its poll was sent, not that it ran: under load the
            # late message could run first (or take the lease first, the new poll waiting on
            # it), and the new poll then first polled after the provider batch had ended,
            # mapping at once: no poll went on polling ('0 polls going on'), the late one's
            # stop unchecked against a poll under way
            polling_on = re.compile(r"Task sift\.economy_poll\[rewake-[0-9a-f]+\] retry:")
            wait_for(
                lambda: polling_on.search(log_b.read_text(errors="replace")) is not None,
                "the sweep's new poll polling on, the provider batch in_progress",
                120,
            )
            broker.lpush("sift.batch", late)  # and now the late message arrives
            late_id = json.loads(late)["headers"]["id"]
            ran = re.compile(rf"economy_poll\[{late_id}\] (succeeded|retry:)")
            wait_for(
                lambda: ran.search(log_b.read_text(errors="replace")) is not None,
                "the late message run, the provider batch still in_progress",
                120,
            )
            assert model.batches()[0]["status"] == "in_progress"
            model.configure(batch_processing_seconds=0.0)  # the provider batch ends now
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        log = log_b.read_text(errors="replace")
        polling = set(re.findall(r"Task sift\.economy_poll\[([^\]]+)\] retry:", log))
        assert len(polling) == 1, f"{len(polling)} polls going on: {sorted(polling)}"
        assert log.count(f"provider batch {provider} mapped") == 1
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 5)
        assert len(model.batches()) == 1
