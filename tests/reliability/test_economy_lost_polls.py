"""The economy lane when a poll's message is lost or late after its worker was SIGKILLed,
at default settings (the stack and helpers of :mod:`tests.reliability.test_economy_crash`;
a file of its own so that the test runs beside that file's, not after them).

- killed while its poll waits out its countdown, and that poll's message then lost (taken
  out of the broker, as kombu's pop-then-record window loses one): the new worker's re-drive
  sweep sends the poll again once it is overdue, and the batch finishes;
- the same, but the message only late: the sweep's new poll and the late one never both go
  on polling;
- a chunk message lost before any worker took it (its items still ``queued``, so no
  submission can start): the re-drive sends it again, and one submission makes one
  provider batch of every item;
- the submission's message delivered again while its run's create is still under way (no
  provider batch made yet): the second run stands down; one provider batch;
- the submission's worker stalled (SIGSTOP) past its heartbeat during that slow create: its
  message goes to another worker, whose run takes the lease over and finds the create in
  doubt with no candidate yet; it waits out the doubt window rather than send the items
  again; one provider batch.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic, slow
from tests.reliability.support import all_results, assert_batch_exactly_once, ingest, wait_for
from tests.reliability.test_economy_crash import (
    FINISH_WINDOW,
    economy_stack,
    finished,
    submit_economy,
    worker,
)
from worker.constants import (
    ECONOMY_POLL_TASK,
    ECONOMY_RUNS_KEY,
    ECONOMY_SUBMIT_TASK,
    ECONOMY_WATCH_KEY,
    KOMBU_UNACKED_INDEX_KEY,
    KOMBU_UNACKED_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.queue.economy import SUBMIT_CLAIM, position_of
from worker.queue.redrive import coverage

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


def _lose_chunk(client: redis.Redis, batch_id: str) -> list[int]:
    """Take one chunk message of the batch out of the broker's queue (lost, as kombu's
    pop-then-record window loses one); answers its ``[start, stop)``."""
    for queue in client.keys("sift.*"):
        if client.type(queue) != "list":
            continue
        for raw in client.lrange(queue, 0, -1):
            found = coverage(json.loads(raw))
            if found is not None and found.job_id == batch_id:
                assert client.lrem(queue, 1, raw) == 1
                return [found.positions.start, found.positions.stop]
    raise AssertionError("no chunk message of the batch in the broker")


def test_a_lost_chunk_message_is_sent_again_and_makes_one_submission(tmp_path: Path) -> None:
    # The batch is submitted while no worker runs, and one of its two chunk messages is lost
    # before any worker takes it: its items stay queued, the other chunk's are prepared, and
    # no submission can start. The re-drive's sweep (stall 120 s, two sweeps 30 s apart, at
    # the defaults) sends the lost chunk again; one submission follows, one provider batch.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        with worker(tmp_path / "w", env, "a"):
            ingest(client)
        batch_id = submit_economy(client, 30)  # two chunks of the default 25
        assert _lose_chunk(broker, batch_id) in ([0, 25], [25, 30])
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", 400)
        log = (tmp_path / "w" / "b.log").read_text(errors="replace")
        assert "on two sweeps; re-driven" in log
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 30)
        [made] = model.batches()  # every item in the one provider batch, sent once
        assert len(made["custom_ids"]) == 30
        assert {position_of(c) for c in made["custom_ids"]} == set(range(30))


def _pending(broker: redis.Redis, batch_id: str) -> int:
    """How many of the batch's items wait on a create recorded but not yet answered."""
    runs = [json.loads(r) for r in broker.hvals(ECONOMY_RUNS_KEY + batch_id)]
    return sum(1 for r in runs if r.get("pending"))


def _assert_one_provider_batch_answered_all(
    model: FakeAnthropic, client: httpx.Client, env: dict[str, str], batch_id: str, items: int
) -> None:
    """One provider batch made (paid once), holding every item, and each item answered by
    it in one attempt, finished exactly once."""
    made = model.batches()
    assert len(made) == 1, [b["id"] for b in made]
    assert len(made[0]["custom_ids"]) == items
    assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, items)
    for item in all_results(client, batch_id):
        assert item["status"] == "succeeded", item
        attempts = item["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["ok"], attempts
        assert attempts[0]["provider_batch"] == made[0]["id"]


def test_the_same_submission_delivered_again_during_its_slow_create_stands_down(
    tmp_path: Path,
) -> None:
    # The submission's create takes 20 s before the provider makes the batch (a large body),
    # and its message is delivered again meanwhile (as kombu's restore does once the
    # visibility timeout passes, the run still going on): the same message, the same task
    # id, run by a second thread. It must stand down: run on, it would find the create in
    # doubt, no provider batch made yet, and send the items again: two provider batches.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        model.script_batch_calls("create", [slow(20.0)])

        with worker(tmp_path / "w", env, "a"):
            ingest(client)
            batch_id = submit_economy(client, 3)
            wait_for(lambda: _pending(broker, batch_id) == 3, "the slow create under way", 120)
            [held] = [
                json.loads(raw)[0]
                for raw in broker.hvals(KOMBU_UNACKED_KEY)
                if json.loads(raw)[0]["headers"]["task"] == ECONOMY_SUBMIT_TASK
            ]
            broker.lpush("sift.batch", json.dumps(held))  # the same message, again
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
            log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        _assert_one_provider_batch_answered_all(model, client, env, batch_id, 3)
        assert "this one stands down" in log


def test_a_submission_taken_over_from_a_stalled_worker_waits_for_its_create_in_flight(
    tmp_path: Path,
) -> None:
    # Worker A's create takes 60 s before the provider makes the batch, and A stalls meanwhile
    # (SIGSTOP: a VM paused, a swap storm) past its heartbeat's TTL: worker B's dead-worker
    # check gives A's submission message back, and B's run takes the lease over. The create
    # it finds in doubt has no candidate yet, but its call never came back: it may still be
    # under way, as it is. B must not send the items again before the doubt window ends (two
    # provider batches, paid twice); A, resumed, records the one it made.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        model.script_batch_calls("create", [slow(60.0)])

        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 3)
            wait_for(lambda: _pending(broker, batch_id) == 3, "the slow create under way", 120)
            with worker(tmp_path / "w", env, "b"):
                worker_a.send_signal(signal.SIGSTOP)
                try:
                    log_b = tmp_path / "w" / "b.log"
                    wait_for(
                        lambda: "of dead worker" in log_b.read_text(errors="replace"),
                        "A's submission given back",
                        60,
                    )
                    wait_for(lambda: len(model.batches()) >= 1, "the slow create's batch", 120)
                finally:
                    worker_a.send_signal(signal.SIGCONT)
                wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        _assert_one_provider_batch_answered_all(model, client, env, batch_id, 3)
        assert "may still be under way" in log_b.read_text(errors="replace")
