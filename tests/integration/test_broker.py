"""kombu's close after a dropped Redis connection, step by step as Celery's consumer runs it.

Two consuming channels, each with a ``BRPOP`` in flight and one of them holding an unacked
message; redis-server stops; the consumer ``collect()``s the connection, then ``close()``s it
(celery ``Consumer.on_connection_error_after_connected``); Redis comes back and the task that
held the message acks it. kombu's own transport raises ``AttributeError`` (``'NoneType'
object has no attribute 'hostname'``) from ``close()`` and from the late ack, which kills a
Celery worker (celery/celery#10205); :mod:`worker.queue.broker`'s closes cleanly, and the late ack
removes the message from the ``unacked`` hash. This is also the reproduction to attach
upstream (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message

from tests.services import free_port, redis_server
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
    """The upstream bug, as of kombu 5.7. When this fails, kombu has fixed it: drop
    :mod:`worker.queue.broker` and this module (and update docs/reliability.md)."""
    closed, acked, unacked = _drop_under_consumer(tmp_path, None)
    assert isinstance(closed, AttributeError) and "hostname" in str(closed), repr(closed)
    assert isinstance(acked, AttributeError), repr(acked)
    assert unacked == 1  # the finished task's message would run again after the timeout


def test_sifts_transport_closes_cleanly_and_acks_late(tmp_path: Path) -> None:
    closed, acked, unacked = _drop_under_consumer(tmp_path, TRANSPORT)
    assert closed is None, repr(closed)
    assert acked is None, repr(acked)
    assert unacked == 0


def test_the_transport_is_ours_only_for_plain_redis_urls() -> None:
    assert broker_transport("redis://127.0.0.1:6379/0") == TRANSPORT
    assert broker_transport("rediss://cache.example:6380/0") is None  # kombu sets TLS up
    assert broker_transport("sentinel://10.0.0.1:26379") is None
