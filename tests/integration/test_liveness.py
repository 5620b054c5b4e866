"""Dead-worker recovery against a real redis-server and kombu's real Redis transport.

The messages are taken the way a worker takes them (kombu's ``basic_get`` without ack: the
message goes into ``unacked`` and ``unacked_index``); the reaper then puts back exactly the
ones it should, once, and kombu's own restores afterwards find nothing left to requeue.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.message import Message

from tests.integration.beats import BEAT, Beats, check_twice
from worker.constants import (
    ALL_QUEUES,
    BATCH_QUEUE,
    DELIVERY_OWNERS_KEY,
    ECONOMY_SENDER_KEY,
    KOMBU_UNACKED_INDEX_KEY,
    KOMBU_UNACKED_KEY,
    REDRIVE_URGENT_KEY,
    SEARCH_QUEUE,
    WORKERS_KEY,
)
from worker.queue.liveness import Liveness, economy_model, economy_sender_alive
from worker.queue.reaper import Reaper, heartbeat_key, plan_restore

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def beats() -> Beats:
    """The clock this test's reapers count beats on (:mod:`tests.integration.beats`)."""
    return Beats()


@pytest.fixture
def connection(redis_url: str, client: redis.Redis) -> Iterator[Connection]:
    """kombu on the same database, with the visibility timeout a worker has by default."""
    with Connection(redis_url, transport_options={"visibility_timeout": 1665}) as conn:
        yield conn


def queue(name: str) -> Queue:
    """A Sift queue as the worker declares it: a direct exchange named like it."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def take(connection: Connection, name: str, body: dict[str, object]) -> Message:
    """Publish ``body`` to queue ``name`` and take it unacked, as a worker's consumer does."""
    target = queue(name)
    with connection.Producer() as producer:
        producer.publish(
            body, exchange=target.exchange, routing_key=name, declare=[target], serializer="json"
        )
    message = target(connection.default_channel).get(no_ack=False)
    assert message is not None
    return message


def reaper(client: redis.Redis, beats: Beats, orphan_seconds: float = 60.0) -> Reaper:
    return Reaper(
        client,
        heartbeat_seconds=BEAT,
        dead_after_seconds=2 * BEAT,
        orphan_seconds=orphan_seconds,
        clock=beats,
    )


def test_a_check_more_than_three_beats_after_the_last_starts_over(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    """After no check for over three beats (a Redis outage, every worker stalled), whom the
    checks saw silent is forgotten: a worker silent then and now may have beaten in between.
    (The tests
    ran their checks by the real clock and a loaded machine crossed this line: see
    :mod:`tests.integration.beats`.)"""
    message = take(connection, BATCH_QUEUE, {"n": 9})
    client.hset(DELIVERY_OWNERS_KEY, str(message.delivery_tag), "dead-worker")
    r = reaper(client, beats)
    assert r.check() == {}
    beats.now += 3 * BEAT + 0.01
    assert r.check() == {}  # silent on both, but what it saw first is forgotten
    beats.pass_two()
    assert r.check() == {"dead-worker": 1}


def test_checkers_taking_turns_find_a_dead_worker(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    """Each worker process checks on the beats it wins the lock for, and the lock passes from
    one to another: what the checks saw is kept in Redis for whoever checks next. Four
    reapers (four worker processes) checking in turn, one beat apart, find a silent worker
    dead two or three beats after the first check, and put its delivery back once. Before,
    each kept its own view and dropped it after three beats without a check of its own:
    taking turns four beats apart, none ever found it dead (a SIGKILLed one of `sift
    worker`'s two processes was found 32 s after the kill in one run of eight, against 14 to
    21 s in the others)."""
    message = take(connection, BATCH_QUEUE, {"n": 4})
    client.hset(DELIVERY_OWNERS_KEY, str(message.delivery_tag), "dead-worker")
    reapers = [reaper(client, beats) for _ in range(4)]
    found: dict[str, int] = {}
    for turn in range(12):
        found = reapers[turn % 4].check()
        if found:
            break
        beats.now += BEAT
        time.sleep(BEAT)  # real time too: the delivery is older than the dead one's last TTL
    assert found == {"dead-worker": 1}, "no checker found the silent worker dead"
    assert turn <= 3
    assert client.llen(BATCH_QUEUE) == 1 and client.hlen(KOMBU_UNACKED_KEY) == 0
    assert all(r.check() == {} for r in reapers)  # back once


@pytest.mark.parametrize("name", ALL_QUEUES)
def test_a_dead_worker_s_delivery_goes_back_once(
    client: redis.Redis, connection: Connection, beats: Beats, name: str
) -> None:
    """Searches, batch chunks, ingests and webhooks alike."""
    message = take(connection, name, {"n": 1})
    tag = str(message.delivery_tag)
    client.hset(DELIVERY_OWNERS_KEY, tag, "dead-worker")  # no heartbeat: it is dead
    assert reaper(client, beats).check() == {}  # one check is not enough (a Redis outage)
    assert client.llen(name) == 0
    r = reaper(client, beats)
    assert check_twice(r, beats) == {"dead-worker": 1}
    assert client.llen(name) == 1
    assert client.hlen(KOMBU_UNACKED_KEY) == 0 and client.zcard(KOMBU_UNACKED_INDEX_KEY) == 0
    assert client.hlen(DELIVERY_OWNERS_KEY) == 0
    # kombu's own restores now find nothing: no second copy
    channel = connection.default_channel
    channel.qos.restore_by_tag(tag)
    channel.qos.restore_visible(num=100)
    assert client.llen(name) == 1
    assert r.check() == {}
    again = queue(name)(channel).get(no_ack=False)
    assert again is not None and again.payload == {"n": 1}
    assert again.delivery_info.get("redelivered") or again.headers.get("redelivered")


def test_a_live_worker_s_delivery_stays_however_old(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    message = take(connection, SEARCH_QUEUE, {"n": 2})
    tag = str(message.delivery_tag)
    client.hset(DELIVERY_OWNERS_KEY, tag, "live-worker")
    client.set(heartbeat_key("live-worker"), "1", px=10_000)
    client.zadd(KOMBU_UNACKED_INDEX_KEY, {tag: time.time() - 3600})  # taken an hour ago
    assert check_twice(reaper(client, beats, orphan_seconds=1), beats) == {}
    assert client.llen(SEARCH_QUEUE) == 0 and client.hexists(KOMBU_UNACKED_KEY, tag)


def test_an_orphan_goes_back_only_once_older_than_the_margin(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    message = take(connection, BATCH_QUEUE, {"n": 3})
    tag = str(message.delivery_tag)
    r = reaper(client, beats, orphan_seconds=60)
    assert check_twice(r, beats) == {}  # no owner, but taken just now: a worker is recording it
    client.zadd(KOMBU_UNACKED_INDEX_KEY, {tag: time.time() - 61})
    assert r.check() == {"": 1}
    assert client.llen(BATCH_QUEUE) == 1 and client.hlen(KOMBU_UNACKED_KEY) == 0


def test_a_delivery_taken_after_its_recorded_owner_died_is_not_its(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    """A dead worker's message, requeued and taken again by a live worker whose record of
    it has not landed yet, still names the dead worker: it was taken too recently to be
    the dead one's, so it stays."""
    message = take(connection, BATCH_QUEUE, {"n": 7})
    tag = str(message.delivery_tag)
    client.hset(DELIVERY_OWNERS_KEY, tag, "dead-worker")
    r = Reaper(
        client, heartbeat_seconds=BEAT, dead_after_seconds=10.0, orphan_seconds=60, clock=beats
    )
    assert check_twice(r, beats) == {}
    assert client.llen(BATCH_QUEUE) == 0 and client.hexists(KOMBU_UNACKED_KEY, tag)
    client.zadd(KOMBU_UNACKED_INDEX_KEY, {tag: time.time() - 11})
    assert r.check() == {"dead-worker": 1}


def test_an_acked_delivery_of_a_dead_worker_only_loses_its_record(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    message = take(connection, BATCH_QUEUE, {"n": 4})
    tag = str(message.delivery_tag)
    client.hset(DELIVERY_OWNERS_KEY, tag, "dead-worker")
    message.ack()
    assert check_twice(reaper(client, beats), beats) == {}
    assert client.llen(BATCH_QUEUE) == 0 and client.hlen(DELIVERY_OWNERS_KEY) == 0


def test_a_heartbeat_back_before_the_restore_keeps_the_delivery(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    """The script itself checks the heartbeat: a worker beating again between the check's
    read and its restore keeps its message."""
    message = take(connection, BATCH_QUEUE, {"n": 5})
    tag = str(message.delivery_tag)
    client.hset(DELIVERY_OWNERS_KEY, tag, "w")
    raw = client.hget(KOMBU_UNACKED_KEY, tag)
    r = reaper(client, beats)
    client.set(heartbeat_key("w"), "1", px=10_000)
    assert not r._put_back(tag, "w", raw, time.time())
    assert client.llen(BATCH_QUEUE) == 0 and client.hexists(KOMBU_UNACKED_KEY, tag)


def test_concurrent_restores_requeue_each_message_once(
    client: redis.Redis, connection: Connection, redis_url: str, beats: Beats
) -> None:
    """Four reapers and kombu's visibility restore race over 50 dead deliveries."""
    tags = [str(take(connection, BATCH_QUEUE, {"n": i}).delivery_tag) for i in range(50)]
    client.hset(DELIVERY_OWNERS_KEY, mapping=dict.fromkeys(tags, "dead"))
    client.zadd(KOMBU_UNACKED_INDEX_KEY, {tag: time.time() - 4000 for tag in tags})
    reapers = [
        reaper(redis.Redis.from_url(redis_url, decode_responses=True), beats) for _ in range(4)
    ]
    for r in reapers:
        r.check()  # each has seen the dead worker once
    beats.pass_two()  # each then finds it dead (by the real clock, late ones forgot it)
    go = threading.Barrier(len(reapers))  # three reapers and kombu

    def run(r: Reaper) -> None:
        go.wait()
        r.check()

    def kombu_restore() -> None:
        with Connection(redis_url, transport_options={"visibility_timeout": 1}) as conn:
            go.wait()
            conn.default_channel.qos.restore_visible(num=100)

    threads = [threading.Thread(target=run, args=(r,)) for r in reapers[:-1]]
    threads.append(threading.Thread(target=kombu_restore))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    reapers[-1].check()
    bodies = [json.loads(raw)["body"] for raw in client.lrange(BATCH_QUEUE, 0, -1)]
    assert len(bodies) == 50 and len(set(bodies)) == 50
    assert client.hlen(KOMBU_UNACKED_KEY) == 0


def test_plan_restore_follows_the_binding_and_the_priority(
    client: redis.Redis, connection: Connection
) -> None:
    message = take(connection, SEARCH_QUEUE, {"n": 6})
    raw = client.hget(KOMBU_UNACKED_KEY, str(message.delivery_tag))
    assert raw is not None
    plan = plan_restore(client, raw)
    assert plan is not None and plan.queues == [SEARCH_QUEUE]
    entry = json.loads(raw)
    entry[0]["properties"]["priority"] = 7
    plan = plan_restore(client, json.dumps(entry))
    assert plan is not None and plan.queues == [SEARCH_QUEUE + "\x06\x166"]
    assert json.loads(plan.message)["headers"]["redelivered"] is True
    assert plan_restore(client, json.dumps([{}, "elsewhere", "elsewhere"])) is None


def test_a_worker_records_what_it_holds_and_drops_it_after_the_ack(client: redis.Redis) -> None:
    liveness = Liveness(
        client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=1.0, orphan_seconds=60
    )
    liveness.hold("t1")
    liveness.hold("t2")
    liveness.beat()
    assert client.hgetall(DELIVERY_OWNERS_KEY) == {"t1": "w1", "t2": "w1"}
    assert 0 < client.pttl(heartbeat_key("w1")) <= 1000
    liveness.release("t1")
    client.hset(DELIVERY_OWNERS_KEY, "t2", "w2")  # t2 was requeued and taken by w2
    liveness.release("t2")
    liveness.flush()
    assert client.hgetall(DELIVERY_OWNERS_KEY) == {"t2": "w2"}  # only its own record dropped
    liveness.hold("t3")
    liveness.release("t3")  # acked before it was ever written: nothing to write
    liveness.flush()
    assert client.hgetall(DELIVERY_OWNERS_KEY) == {"t2": "w2"}
    liveness.stop()
    assert not client.exists(heartbeat_key("w1"))


def test_a_worker_that_can_send_economy_batches_says_so_at_each_beat(client: redis.Redis) -> None:
    """Only a worker with a model that consumes the batch queue (where the economy lane's
    submission goes) counts as one that can send economy batches; its beat sets the key with
    the heartbeat's TTL, and a clean stop leaves it (another such worker may live: it
    expires with the last one's heartbeat). The queues are read at each beat: one the worker
    stopped consuming at run time (an operator's ``cancel_consumer``) no longer counts, and
    one added again counts again."""
    assert economy_model("claude-haiku-4-5", ALL_QUEUES) == "claude-haiku-4-5"
    assert economy_model("claude-haiku-4-5", [SEARCH_QUEUE]) is None  # never takes one
    assert economy_model(None, ALL_QUEUES) is None
    without = Liveness(client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=1.0,
                       orphan_seconds=60, consumed=lambda: ALL_QUEUES)  # fmt: skip
    without.beat()
    assert not economy_sender_alive(client)
    queues = list(ALL_QUEUES)
    sender = Liveness(client, "w2", heartbeat_seconds=BEAT, dead_after_seconds=1.0,
                      orphan_seconds=60, generation_model="claude-haiku-4-5",
                      consumed=lambda: queues)  # fmt: skip
    sender.beat()
    assert economy_sender_alive(client)
    assert client.get(ECONOMY_SENDER_KEY) == "claude-haiku-4-5"
    assert 0 < client.pttl(ECONOMY_SENDER_KEY) <= 1000  # as long as its heartbeat lives
    client.delete(ECONOMY_SENDER_KEY)  # as if it had expired
    queues.remove(BATCH_QUEUE)  # cancelled at run time
    sender.beat()
    assert not economy_sender_alive(client)
    queues.append(BATCH_QUEUE)  # added again
    sender.beat()
    assert client.get(ECONOMY_SENDER_KEY) == "claude-haiku-4-5"
    sender.stop()
    without.stop()
    assert economy_sender_alive(client)


def test_a_delivery_acked_while_its_record_is_being_written_is_dropped_after(
    client: redis.Redis,
) -> None:
    liveness = Liveness(
        client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=1.0, orphan_seconds=60
    )
    liveness.hold("t1")
    written = threading.Event()
    acked = threading.Event()
    execute = redis.client.Pipeline.execute

    def slow_execute(pipe: redis.client.Pipeline, *args: object, **kwargs: object) -> object:
        written.set()
        acked.wait(5)  # the ack lands while the HSET is on its way
        return execute(pipe, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(redis.client.Pipeline, "execute", slow_execute)
        flusher = threading.Thread(target=liveness.flush)
        flusher.start()
        assert written.wait(5)
        liveness.release("t1")
        acked.set()
        flusher.join(5)
    assert client.hget(DELIVERY_OWNERS_KEY, "t1") == "w1"  # written after the ack...
    liveness.flush()
    assert not client.hexists(DELIVERY_OWNERS_KEY, "t1")  # ...and dropped by the next flush


def test_a_dead_worker_opens_the_redrive_s_urgent_window_once(
    client: redis.Redis, connection: Connection, beats: Beats, caplog: pytest.LogCaptureFixture
) -> None:
    """Found dead, even with nothing to put back (it may have popped a message it never
    recorded): the re-drive's next two sweeps (2.5 intervals) look at every active job. A
    worker found dead on every beat, its delivery not yet old enough to go back, opens it
    once; so does nothing when the re-drive is off."""
    message = take(connection, BATCH_QUEUE, {"n": 8})
    client.hset(DELIVERY_OWNERS_KEY, str(message.delivery_tag), "dead-worker")
    off = Reaper(
        client, heartbeat_seconds=BEAT, dead_after_seconds=10.0, orphan_seconds=60, clock=beats
    )
    assert check_twice(off, beats) == {} and not client.exists(REDRIVE_URGENT_KEY)

    r = Reaper(
        client,
        heartbeat_seconds=BEAT,
        dead_after_seconds=10.0,  # taken just now: too recent to be the dead worker's to put back
        orphan_seconds=60,
        redrive_interval_seconds=30,
        clock=beats,
    )
    with caplog.at_level("WARNING", logger="worker.queue.redrive"):
        assert check_twice(r, beats) == {}
        assert 0 < client.pttl(REDRIVE_URGENT_KEY) <= 75_000
        client.delete(REDRIVE_URGENT_KEY)
        assert r.check() == {}  # still dead, its delivery still here: announced already
    assert not client.exists(REDRIVE_URGENT_KEY)
    assert [rec.getMessage() for rec in caplog.records if "found dead" in rec.getMessage()] == [
        "re-drive: worker dead-worker found dead; for the next 75s its sweeps look at every "
        "active job, not only idle ones"
    ]


def test_a_worker_killed_holding_nothing_is_found_dead_too(
    client: redis.Redis, beats: Beats
) -> None:
    """Killed right after a pop, before recording anything: its message is lost and it holds
    no delivery, so only the set of workers shows it was there. A live worker and one that
    stopped cleanly open no window. (Their heartbeats last 60 s: a live worker's key must
    not lapse between its beat and the check, however late a loaded machine runs the check.)"""
    killed, live, stopped = (
        Liveness(client, name, heartbeat_seconds=BEAT, dead_after_seconds=60, orphan_seconds=60)
        for name in ("killed", "live", "stopped")
    )
    for worker in (killed, live, stopped):
        worker.beat()
    assert client.smembers(WORKERS_KEY) == {"killed", "live", "stopped"}
    stopped.stop()
    client.delete(heartbeat_key("killed"))  # SIGKILLed: its heartbeat lapses, nothing else
    r = Reaper(
        client,
        heartbeat_seconds=BEAT,
        dead_after_seconds=2 * BEAT,
        orphan_seconds=60,
        redrive_interval_seconds=30,
        clock=beats,
    )
    r.check()
    live.beat()
    beats.pass_two()
    live.beat()
    assert r.check() == {}  # nothing to put back
    assert client.get(REDRIVE_URGENT_KEY) == "worker killed found dead"
    assert client.smembers(WORKERS_KEY) == {"live"}
    client.delete(REDRIVE_URGENT_KEY)
    live.beat()
    assert r.check() == {} and not client.exists(REDRIVE_URGENT_KEY)


def test_a_dead_worker_s_deliveries_are_taken_again_first_in_the_order_taken(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    """Batch A's chunks, held by the dead worker, go back ahead of batch B's waiting chunk,
    the first taken first."""
    held = [take(connection, BATCH_QUEUE, {"n": name}) for name in ("A1", "A2", "A3")]
    for message in held:  # recorded as taken, in that order
        client.hset(DELIVERY_OWNERS_KEY, str(message.delivery_tag), "dead-worker")
    with connection.Producer() as producer:
        producer.publish({"n": "B1"}, exchange=BATCH_QUEUE, routing_key=BATCH_QUEUE)
    assert check_twice(reaper(client, beats), beats) == {"dead-worker": 3}  # all three at once
    channel = connection.default_channel
    again = [queue(BATCH_QUEUE)(channel).get(no_ack=True) for _ in range(4)]
    assert [message.payload["n"] for message in again if message] == ["A1", "A2", "A3", "B1"]


class Held:
    """A Celery request as :meth:`Liveness.reconnected` sees it: gone to the pool or not."""

    def __init__(self, handed: bool) -> None:
        self.handed = handed


def test_a_live_worker_puts_back_what_its_lost_channel_held_and_never_ran(
    client: redis.Redis, connection: Connection
) -> None:
    """After a reconnect, a delivery the worker still holds but never handed to its pool (a
    countdown Celery dropped with the channel) goes back at once, the first taken first, its
    heartbeat alive; one it is running stays; one acked, or taken again by another worker, is
    left alone; and a second put-back restores nothing more."""
    first, second, running, acked, other = (
        take(connection, BATCH_QUEUE, {"n": n}) for n in range(5)
    )
    liveness = Liveness(
        client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=10.0, orphan_seconds=60
    )
    for message, handed in ((first, False), (second, False), (running, True), (acked, False)):
        liveness.hold(str(message.delivery_tag), Held(handed))
    liveness.hold(str(other.delivery_tag), Held(False))
    liveness.beat()  # alive, each recorded as its own
    acked.ack()
    client.hset(DELIVERY_OWNERS_KEY, str(other.delivery_tag), "w2")  # another worker's now
    liveness.reconnected()
    restored = liveness.put_back_dropped()
    assert restored == [str(second.delivery_tag), str(first.delivery_tag)]  # last taken first
    channel = connection.default_channel
    again = [queue(BATCH_QUEUE)(channel).get(no_ack=False) for _ in range(3)]
    assert [m.payload if m else None for m in again] == [{"n": 0}, {"n": 1}, None]
    assert liveness.held == [str(running.delivery_tag)]  # the dropped ones are let go
    assert client.hexists(KOMBU_UNACKED_KEY, str(running.delivery_tag))  # still running here
    liveness.flush()
    assert client.hget(DELIVERY_OWNERS_KEY, str(other.delivery_tag)) == "w2"  # not ours
    liveness.reconnected()
    assert liveness.put_back_dropped() == []
    assert client.llen(BATCH_QUEUE) == 0


def test_a_delivery_taken_again_after_the_reconnect_is_not_put_back(
    client: redis.Redis, connection: Connection
) -> None:
    """The same tag taken again after the reconnect (kombu's close put it back while Redis
    stayed up) is the new channel's: it stays with the request that holds it now."""
    message = take(connection, BATCH_QUEUE, {"n": 9})
    tag = str(message.delivery_tag)
    liveness = Liveness(
        client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=10.0, orphan_seconds=60
    )
    liveness.hold(tag, Held(False))
    liveness.beat()
    liveness.reconnected()
    again = Held(False)
    liveness.hold(tag, again)  # redelivered, held by the consumer's new channel
    client.zadd(KOMBU_UNACKED_INDEX_KEY, {tag: time.time() + 1})  # taken after the reconnect
    assert liveness.put_back_dropped() == []
    assert client.hexists(KOMBU_UNACKED_KEY, tag) and liveness.held == [tag]


def test_a_delivery_another_worker_took_again_before_the_reconnect_is_not_put_back(
    client: redis.Redis, connection: Connection, redis_url: str
) -> None:
    """Redis stays up but the connection drops (review6 finding 2): kombu's close puts the
    delivery back, a second worker takes it before this worker's consumer starts again and
    before it records the take. This worker's own record still names it, the unacked entry
    is a message with the same tag, taken before the reconnect: it is the second worker's
    take all the same, and stays with it (no second run)."""
    message = take(connection, BATCH_QUEUE, {"n": 7})
    tag = str(message.delivery_tag)
    liveness = Liveness(
        client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=10.0, orphan_seconds=60
    )
    liveness.hold(tag, Held(False))  # a countdown, waiting on its timer
    liveness.beat()  # recorded as w1's
    connection.default_channel.qos.restore_unacked()  # kombu's close: back on the queue
    with Connection(redis_url, transport_options={"visibility_timeout": 1665}) as other:
        again = queue(BATCH_QUEUE)(other.default_channel).get(no_ack=False)
        assert again is not None and str(again.delivery_tag) == tag  # the second worker's
        assert client.hget(DELIVERY_OWNERS_KEY, tag) == "w1"  # its record not written yet
        liveness.reconnected()
        assert liveness.put_back_dropped() == []
        assert client.hexists(KOMBU_UNACKED_KEY, tag)  # still the second worker's
        assert client.llen(BATCH_QUEUE) == 0  # not queued for a second run


def test_after_a_reconnect_a_worker_drops_its_records_of_what_it_no_longer_holds(
    client: redis.Redis, connection: Connection, beats: Beats
) -> None:
    """Redis came back without its last writes: a delivery this live worker acked is
    ``unacked`` again and recorded as its own. After the reconnect the worker drops that
    record (not the one of a delivery it still holds, nor another worker's), so the orphan
    check puts the message back once it is older than its margin; before, it stayed for the
    visibility timeout, its live owner's."""
    lost, running, others = (take(connection, BATCH_QUEUE, {"n": n}) for n in range(3))
    liveness = Liveness(
        client, "w1", heartbeat_seconds=BEAT, dead_after_seconds=10.0, orphan_seconds=60
    )
    liveness.hold(str(running.delivery_tag), Held(True))
    liveness.beat()
    client.hset(DELIVERY_OWNERS_KEY, str(lost.delivery_tag), "w1")  # its drop lost
    client.hset(DELIVERY_OWNERS_KEY, str(others.delivery_tag), "w2")
    assert liveness.forget_released() == []  # no reconnect: nothing to look at
    liveness.reconnected()
    assert liveness.forget_released() == [str(lost.delivery_tag)]
    assert client.hgetall(DELIVERY_OWNERS_KEY) == {
        str(running.delivery_tag): "w1", str(others.delivery_tag): "w2"
    }  # fmt: skip
    assert liveness.forget_released() == []  # once per reconnect
    # the orphan check, once the message is older than its margin
    client.zadd(KOMBU_UNACKED_INDEX_KEY, {str(lost.delivery_tag): time.time() - 61})
    assert reaper(client, beats).check() == {"": 1}
    again = queue(BATCH_QUEUE)(connection.default_channel).get(no_ack=True)
    assert again is not None and again.payload == {"n": 0}
