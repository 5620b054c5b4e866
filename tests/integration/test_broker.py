"""kombu's close after a dropped Redis connection, step by step as Celery's consumer runs it.

Two consuming channels, each with a ``BRPOP`` in flight and one of them holding an unacked
message; redis-server stops; the consumer ``collect()``s the connection, then ``close()``s it
(celery ``Consumer.on_connection_error_after_connected``); Redis comes back and the task that
held the message acks it. kombu's own transport raises ``AttributeError`` (``'NoneType'
object has no attribute 'hostname'``) from ``close()`` and from the late ack, which kills a
Celery worker (celery/celery#10205); :mod:`worker.queue.broker`'s closes cleanly, and the late ack
removes the message from the ``unacked`` hash. This is also the reproduction to attach
upstream (docs/reliability.md).

Then the order the transport gives a message that goes back to its queue unrun (first in,
first out, docs/queue.md): taken next, before the messages waiting.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message

from tests.services import free_port, redis_server, unable_to_persist
from worker.queue.broker import TRANSPORT, broker_transport

pytestmark = pytest.mark.integration


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


def _drop_under_consumer(
    tmp_path: Path, transport: str | None
) -> tuple[BaseException | None, BaseException | None, int]:
    """Run the sequence; answer what ``close()`` raised, what the late ack raised, and how
    many messages the ``unacked`` hash holds at the end."""
    received: list[Message] = []
    directory, port = tmp_path / "redis", free_port()
    with contextlib.ExitStack() as running:
        url = running.enter_context(redis_server(directory, port=port, appendonly=True))
        jobs = _queue("jobs")
        connection = Connection(url + "/0", transport=transport)
        with connection.channel() as channel:
            Producer(channel).publish({"n": 1}, exchange=jobs.exchange, routing_key="jobs",
                                      declare=[jobs])  # fmt: skip
        consumer = Consumer(
            connection.default_channel, [jobs], prefetch_count=2,
            callbacks=[lambda _body, message: received.append(message)],
        )  # fmt: skip
        other = Consumer(connection.channel(), [_queue("other")], callbacks=[])
        consumer.consume()
        other.consume()
        connection.drain_events(timeout=5)  # the message, now unacked
        with contextlib.suppress(socket.timeout):
            connection.drain_events(timeout=0.3)  # a BRPOP in flight on both channels
        assert len(received) == 1 and connection.default_channel._in_poll
        running.close()  # redis-server stops
        with contextlib.suppress(Exception):
            connection.collect(socket_timeout=2)
        closed: BaseException | None = None
        try:
            connection.close()
        except Exception as exc:  # what it raised is the outcome
            closed = exc
        running.enter_context(redis_server(directory, port=port, appendonly=True))
        acked: BaseException | None = None
        try:
            received[0].ack()  # the task finished after the broker came back
        except Exception as exc:
            acked = exc
        client = redis.Redis.from_url(url + "/0")
        try:
            return closed, acked, int(client.hlen("unacked"))
        finally:
            client.close()


def test_kombus_own_transport_still_raises_attribute_error_on_close(tmp_path: Path) -> None:
    """The upstream bug, as of kombu 5.7. When this fails, kombu has fixed it: drop the
    channel's part of :mod:`worker.queue.broker` and these tests of it (and update
    docs/reliability.md); its QoS, and the order tests below, stay."""
    closed, acked, unacked = _drop_under_consumer(tmp_path, None)
    assert isinstance(closed, AttributeError) and "hostname" in str(closed), repr(closed)
    assert isinstance(acked, AttributeError), repr(acked)
    assert unacked == 1  # the finished task's message would run again after the timeout


def test_sifts_transport_closes_cleanly_and_acks_late(tmp_path: Path) -> None:
    closed, acked, unacked = _drop_under_consumer(tmp_path, TRANSPORT)
    assert closed is None, repr(closed)
    assert acked is None, repr(acked)
    assert unacked == 0


def test_the_transport_is_ours_for_redis_urls_tls_or_not() -> None:
    assert broker_transport("redis://127.0.0.1:6379/0") == TRANSPORT
    assert broker_transport("rediss://cache.example:6380/0") == TRANSPORT  # TLS: broker_use_ssl
    assert broker_transport("sentinel://10.0.0.1:26379") is None


# First in, first out: a message handed back unprocessed is the next one taken. kombu's Redis
# transport publishes with LPUSH and takes with BRPOP (from the right); its reject(requeue=True)
# pushed on the left, behind every message waiting, and its close restored the messages it
# held in reverse. Batch A's chunks (A1, A2) are published before batch B's (B1).


@contextlib.contextmanager
def _fifo_broker(tmp_path: Path) -> Iterator[tuple[Connection, Queue, Queue, Producer]]:
    """Sift's transport on a real redis-server: the connection to consume on, a batch and a
    search queue, and a producer (on a connection of its own) that publishes to both."""
    with redis_server(tmp_path / "redis", port=free_port(), appendonly=True) as url:
        batch, search = _queue("batch"), _queue("search")
        publishing = Connection(url + "/0", transport=TRANSPORT)
        consuming = Connection(url + "/0", transport=TRANSPORT)
        try:
            producer = Producer(publishing.channel(), exchange=batch.exchange,
                                routing_key="batch")  # fmt: skip
            producer.declare()
            for queue in (batch, search):
                queue(publishing.default_channel).declare()
            yield consuming, batch, search, producer
        finally:
            consuming.release()
            publishing.release()


def _publish(producer: Producer, *names: str) -> None:
    for name in names:
        producer.publish({"n": name})


def _take(connection: Connection, queue: Queue, count: int) -> list[str]:
    """The next ``count`` messages a fresh consumer of ``queue`` takes, acked as taken."""
    taken: list[str] = []

    def ack(body: dict[str, str], message: Message) -> None:
        taken.append(body["n"])
        message.ack()

    with connection.channel() as channel, Consumer(channel, [queue], callbacks=[ack]):
        while len(taken) < count:
            connection.drain_events(timeout=5)
    return taken


def test_a_message_read_as_its_consumer_is_cancelled_is_taken_next(tmp_path: Path) -> None:
    """The intake pause: the batch queue's consumer is cancelled while a BRPOP is in flight,
    and Redis answers it with A1; kombu hands A1 back (no consumer for its queue)."""
    with _fifo_broker(tmp_path) as (connection, batch, search, producer):
        consumer = Consumer(connection.default_channel, [batch, search], callbacks=[])
        consumer.consume()
        with contextlib.suppress(socket.timeout):
            connection.drain_events(timeout=0.3)  # nothing yet: a BRPOP in flight
        assert connection.default_channel._in_poll
        _publish(producer, "A1", "A2", "B1")  # the BRPOP takes A1; A2 and B1 wait
        consumer.cancel_by_queue("batch")  # the pause
        with contextlib.suppress(socket.timeout):
            connection.drain_events(timeout=0.3)  # the BRPOP's answer: A1, handed back
        assert _take(connection, batch, 3) == ["A1", "A2", "B1"]


def test_a_message_handed_back_is_taken_next(tmp_path: Path) -> None:
    """A stopping worker's chunk (``Reject(requeue=True)``), back before the ones behind it."""
    with _fifo_broker(tmp_path) as (connection, batch, _, producer):
        _publish(producer, "A1", "A2", "B1")
        held: list[Message] = []
        with Consumer(connection.default_channel, [batch], prefetch_count=1,
                      callbacks=[lambda _body, message: held.append(message)]):  # fmt: skip
            connection.drain_events(timeout=5)
        assert [message.payload["n"] for message in held] == ["A1"]
        held[0].reject(requeue=True)
        assert _take(connection, batch, 3) == ["A1", "A2", "B1"]


def test_a_message_handed_back_after_its_close_put_it_back_and_its_copy_was_acked_goes_back(
    tmp_path: Path,
) -> None:
    """A reconnect: the channel's close puts A1 back while its task runs on; the copy taken
    on a new channel (the same delivery tag) is acked (a batch chunk's copy refused by the
    chunk's run claim), which takes A1 from ``unacked``. The run then hands A1 back (a
    SIGTERM): it goes back, the next taken, from the message in hand. kombu's requeue read
    ``unacked`` only, found nothing and put nothing back. One acked instead goes nowhere."""
    with _fifo_broker(tmp_path) as (connection, batch, _, producer):
        _publish(producer, "A1", "B1", "A2", "B2")
        held: list[Message] = []
        channel = connection.channel()
        with Consumer(channel, [batch], prefetch_count=2,
                      callbacks=[lambda _body, message: held.append(message)]):  # fmt: skip
            while len(held) < 2:
                connection.drain_events(timeout=5)
        channel.close()  # the reconnect: kombu restores what it held, the runs go on
        assert _take(connection, batch, 2) == ["A1", "B1"]  # the copies, refused and acked
        held[0].reject(requeue=True)  # A1's run hands it back
        held[1].ack()  # B1's run finishes
        assert _take(connection, batch, 3) == ["A1", "A2", "B2"]


def test_a_closed_channels_messages_come_back_in_the_order_taken(tmp_path: Path) -> None:
    """The messages a channel holds unacked at its close go back first, the first taken first."""
    with _fifo_broker(tmp_path) as (connection, batch, _, producer):
        _publish(producer, "A1", "A2", "A3", "B1")
        held: list[Message] = []
        channel = connection.channel()
        with Consumer(channel, [batch], prefetch_count=3,
                      callbacks=[lambda _body, message: held.append(message)]):  # fmt: skip
            while len(held) < 3:
                connection.drain_events(timeout=5)
        channel.close()  # kombu restores what it held
        assert _take(connection, batch, 4) == ["A1", "A2", "A3", "B1"]


def test_timed_out_messages_come_back_first_in_the_order_taken(tmp_path: Path) -> None:
    """The visibility timeout's restore (kombu's ``restore_visible``, the last resort for a
    dead worker's messages): a channel that took A1 and A2 and never acked nor closed (its
    worker died); another's sweep, once they are older than the timeout, puts them back ahead
    of B1, the first taken first."""
    with _fifo_broker(tmp_path) as (connection, batch, _, producer):
        _publish(producer, "A1", "A2", "B1")
        held: list[Message] = []
        with Consumer(connection.default_channel, [batch], prefetch_count=2,
                      callbacks=[lambda _body, message: held.append(message)]):  # fmt: skip
            while len(held) < 2:
                connection.drain_events(timeout=5)
        connection.default_channel.do_restore = False  # it died: no restore at its close
        url = f"redis://{connection.hostname}:{connection.port}/0"
        sweeping = Connection(url, transport=TRANSPORT, transport_options={"visibility_timeout": 0})
        with sweeping:
            sweeping.default_channel.qos.restore_visible(num=None)  # as kombu's cycle calls it
            assert _take(sweeping, batch, 3) == ["A1", "A2", "B1"]


def test_a_task_that_ends_while_redis_is_at_its_maxmemory_is_acked(tmp_path: Path) -> None:
    """Redis at its ``maxmemory`` (``noeviction``) refuses every command queued in a
    ``MULTI``, deletes too, and kombu's ack is a ``MULTI`` of two deletes: it raised
    ``OutOfMemoryError``, which stopped a Celery worker ("Unrecoverable error") with its batch
    items ``running``. Sent alone, the deletes go through: the message leaves ``unacked``."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        _publish(producer, "A1")
        received: list[Message] = []
        consumer = Consumer(
            connection.default_channel, [batch], prefetch_count=1,
            callbacks=[lambda _body, message: received.append(message)],
        )  # fmt: skip
        consumer.consume()
        connection.drain_events(timeout=5)
        client = redis.Redis(connection.hostname, connection.port or 6379, db=0)
        try:
            assert len(received) == 1 and client.hlen("unacked") == 1
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used // 2)
            try:
                with pytest.raises(redis.exceptions.OutOfMemoryError):  # the refusal is real
                    client.set("probe", "1")
                received[0].ack()
                held = client.hlen("unacked"), client.zcard("unacked_index")
            finally:
                client.config_set("maxmemory", 0)
        finally:
            client.close()
        assert held == (0, 0)


def test_a_message_taken_while_redis_is_at_its_maxmemory_is_delivered(tmp_path: Path) -> None:
    """kombu records a message taken (``BRPOP``) in ``unacked`` with a ``MULTI``, which Redis
    at its ``maxmemory`` refuses: it raised ``OutOfMemoryError`` with the message off its
    queue, which stopped a Celery worker and lost the message. It is delivered unrecorded
    now, and its ack, with nothing to delete, goes through."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        _publish(producer, "A1")
        client = redis.Redis(connection.hostname, connection.port or 6379, db=0)
        received: list[Message] = []
        consumer = Consumer(
            connection.default_channel, [batch], prefetch_count=1,
            callbacks=[lambda _body, message: received.append(message)],
        )  # fmt: skip
        consumer.consume()  # declared while Redis had room (a declare writes too)
        try:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used // 2)
            try:
                connection.drain_events(timeout=5)
                assert [message.payload["n"] for message in received] == ["A1"]
                received[0].ack()
            finally:
                client.config_set("maxmemory", 0)
            assert client.hlen("unacked") == 0 and client.llen("batch") == 0
        finally:
            client.close()


def _taken_while_full(connection: Connection, batch: Queue, client: redis.Redis) -> list[Message]:
    """The messages a consumer of ``batch`` takes (one) while Redis is at its ``maxmemory``:
    taken unrecorded (``unacked`` refused them). Redis has room again on return."""
    received: list[Message] = []
    consumer = Consumer(
        connection.default_channel, [batch], prefetch_count=1,
        callbacks=[lambda _body, message: received.append(message)],
    )  # fmt: skip
    consumer.consume()  # declared while Redis had room (a declare writes too)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)
    try:
        connection.drain_events(timeout=5)
    finally:
        client.config_set("maxmemory", 0)
    assert client.hlen("unacked") == 0  # unrecorded
    return received


def test_a_message_taken_while_redis_was_full_and_handed_back_is_taken_next(
    tmp_path: Path,
) -> None:
    """A message taken unrecorded, handed back (a stopping worker's ``Reject(requeue=True)``):
    it goes back from the message in hand, the next taken. kombu's requeue reads ``unacked``,
    which never held it: it put nothing back, and the work waited for the re-drive."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        _publish(producer, "A1", "B1")
        with redis.Redis(connection.hostname, connection.port or 6379, db=0) as client:
            [held] = _taken_while_full(connection, batch, client)
            held.reject(requeue=True)
            connection.default_channel.close()  # then a close: it is not put back twice
            assert client.llen("batch") == 2
        assert _take(connection, batch, 2) == ["A1", "B1"]


def test_a_message_taken_while_redis_was_full_is_put_back_at_its_channels_close(
    tmp_path: Path,
) -> None:
    """A warm shutdown's close restores a message taken unrecorded and not run: from the
    message in hand, where kombu's restore, reading ``unacked``, put nothing back."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        _publish(producer, "A1", "B1")
        with redis.Redis(connection.hostname, connection.port or 6379, db=0) as client:
            _taken_while_full(connection, batch, client)
            connection.default_channel.close()
            assert client.llen("batch") == 2
        assert _take(connection, batch, 2) == ["A1", "B1"]


def test_a_message_taken_while_redis_was_full_and_acked_is_never_put_back(
    tmp_path: Path,
) -> None:
    """Acked (its task ran), a message taken unrecorded is forgotten: no close puts it back."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        _publish(producer, "A1")
        with redis.Redis(connection.hostname, connection.port or 6379, db=0) as client:
            [held] = _taken_while_full(connection, batch, client)
            held.ack()
            connection.default_channel.close()
            assert client.llen("batch") == 0


# A Redis that cannot persist to its disk (MISCONF: its AOF write or RDB save failed, a full
# disk) refuses every write, and PING, until a write to its disk succeeds. BRPOP, and the
# ack's HDEL and ZREM, are writes: kombu raised the plain ResponseError, no connection error
# to it or to Celery, whose worker stopped ("Unrecoverable error"), again at each restart.


def test_a_consumer_on_a_redis_that_cannot_persist_meets_a_connection_error(
    tmp_path: Path,
) -> None:
    """The refused BRPOP is a connection error (Celery reconnects, with its back-off), and so
    is a new channel's PING while the refusal lasts; once Redis can write, a new channel
    takes the message waiting."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        consumer = Consumer(connection.default_channel, [batch], callbacks=[])
        consumer.consume()  # no BRPOP sent yet
        _publish(producer, "A1")
        with redis.Redis(connection.hostname, connection.port or 6379, db=0) as client:
            with unable_to_persist(client):
                with pytest.raises(connection.connection_errors) as refused:
                    connection.drain_events(timeout=5)
                assert "MISCONF" in str(refused.value.__cause__), repr(refused.value)
                with pytest.raises(connection.connection_errors):
                    Connection(f"redis://{connection.hostname}:{connection.port}/0",
                               transport=TRANSPORT).channel()  # fmt: skip
            assert client.llen("batch") == 1  # refused: still waiting
        assert _take(connection, batch, 1) == ["A1"]


def test_an_ack_on_a_redis_that_cannot_persist_is_a_connection_error(tmp_path: Path) -> None:
    """A task ending while Redis cannot write: its ack is refused as a lost connection is
    (Celery logs it and runs on; the message, still in ``unacked``, runs again once put back)."""
    with _fifo_broker(tmp_path) as (connection, batch, _search, producer):
        _publish(producer, "A1")
        received: list[Message] = []
        consumer = Consumer(
            connection.default_channel, [batch], prefetch_count=1,
            callbacks=[lambda _body, message: received.append(message)],
        )  # fmt: skip
        consumer.consume()
        connection.drain_events(timeout=5)
        with redis.Redis(connection.hostname, connection.port or 6379, db=0) as client:
            assert client.hlen("unacked") == 1
            qos = connection.default_channel.qos
            with unable_to_persist(client):
                with pytest.raises(connection.connection_errors):
                    qos.ack(received[0].delivery_tag)
                with pytest.raises(connection.connection_errors):  # a hand-back's transaction too
                    qos.reject(received[0].delivery_tag, requeue=True)
            assert client.hlen("unacked") == 1 and client.llen("batch") == 0
            received[0].ack()  # Redis can write again
            assert client.hlen("unacked") == 0
