"""kombu's Redis transport with two fixes: a worker keeps consuming after Redis restarts, and a
message that goes back to its queue unrun is the next one taken (first in, first out).

The bug (kombu 5.7 / celery 5.7; reported as celery/celery#10205). When the broker connection
drops, Celery's consumer first ``collect()``s the kombu connection, then ``close()``s it:

1. ``collect()`` closes each channel. kombu's Redis ``Channel.close()`` first reads the pending
   ``BRPOP`` reply (or deletes its auto-delete fanout queues); with Redis gone that raises a
   connection error, which kombu swallows, before the channel is marked closed. ``collect()``
   then detaches the transport from its connection: ``transport.client = None``.
2. ``close()`` closes the still-open channel again. This time it gets to restoring its
   unacknowledged messages, which needs a new connection pool, whose parameters are read
   from ``transport.client.hostname``: ``AttributeError: 'NoneType' object has no attribute
   'hostname'``. That is no connection error, so Celery logs "Unrecoverable error" and the
   worker process exits (with status 0).

A task that was still running on the old channel would hit the same wall when it acks: the
closed channel's ``connection`` is ``None`` by then.

The fix: the channel keeps the parameters it was opened with, and uses them once its transport
has let go of the connection. The restore and the late acks then reach Redis like any other
command: they fail as connection errors while Redis is down (which kombu and Celery handle; an
unacknowledged message stays in the ``unacked`` hash: a running task acks it once Redis is
back, and the worker puts back the ones Celery dropped unrun as its consumer starts again,
:meth:`worker.queue.liveness.Liveness.reconnected`, not after the visibility timeout), and
succeed once it is back (a late ack removes its message from that hash).

The order (:class:`QoS`). A message is published with ``LPUSH`` and taken with ``BRPOP``, from
the right. kombu puts a message handed back unprocessed (``reject(requeue=True)``) at the left
end, behind every message waiting, with ``LPUSH``: a chunk read by a ``BRPOP`` already in
flight when the worker's intake pause (:mod:`worker.queue.intake`) cancelled the batch queue's
consumer (kombu hands a message for a queue nobody consumes back that way), or a chunk a
stopping worker hands back, ran after a whole later batch. Here it goes back to the right end
(of its priority's list), the next one taken, as its channel's unacknowledged messages at a
close and a timed-out message (``restore_visible``) already do. The close now pushes its
messages oldest last, so the oldest is taken first (kombu pushed them in the order taken, so
the last one taken came back first).

A message handed back after a reconnect. The close puts back a message whose task runs on;
the copy taken since has its delivery tag, and a batch chunk's copy, refused by the chunk's
run claim, is acked, which takes the message from ``unacked``. kombu's requeue reads
``unacked`` only, so the running chunk's hand-back at a SIGTERM then put nothing back: its
items not started waited for the re-drive. :class:`QoS` keeps each message its close put back
in hand until its task acks or rejects it, and a hand-back ``unacked`` no longer holds goes
back from that one, the same message, the next taken.

A Redis that cannot persist to its disk (``MISCONF``) refuses every write, and PING, until a
write to its disk succeeds: the ``BRPOP`` and the ack's deletes among them. redis-py raises a
plain ``ResponseError``, no connection error to kombu or Celery, and every worker process
stopped ("Unrecoverable error"). The channel's connections raise :class:`CannotPersist` for
it, a connection error: Celery reconnects with its back-off and consumes again once Redis can
write (``tests/reliability/test_redis_disk_full_worker.py``).

``celery_config`` selects this transport for ``redis://`` and ``rediss://`` broker URLs (TLS
from ``broker_use_ssl``, :func:`broker_ssl`); every other scheme keeps kombu's own.
``tests/reliability/test_broker_restart.py`` restarts Redis under a worker (and
``tests/reliability/test_broker_tls.py`` a TLS one); ``tests/integration/test_broker.py``
checks both the close and the order, and ``tests/integration/test_batch_order.py`` the order
over real workers.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from urllib.parse import parse_qs, urlparse

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from worker.redis_client import CANNOT_PERSIST, cannot_persist

log = logging.getLogger(__name__)

TRANSPORT = "worker.queue.broker:Transport"

# the TLS parameters of a rediss:// URL that redis-py reads (and kombu passes on to it)
SSL_PARAMETERS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class CannotPersist(redis.ConnectionError):
    """Redis refused a command on the broker's connection because it cannot persist to its
    disk (``MISCONF``: a full disk, most often; :func:`worker.redis_client.cannot_persist`).

    Raised in place of redis-py's plain ``ResponseError`` so that kombu and Celery take it
    for a lost connection, as Redis unavailable: Celery's consumer reconnects with its
    back-off, and consumes again once Redis can write. ``BRPOP`` and the ack's deletes are
    writes: the ``ResponseError`` they met stopped Celery's worker ("Unrecoverable error"),
    and again at every restart while the disk stayed full. (kombu's connections are made
    with no retry: redis-py does not send the command again in place.)"""


def refusing_misconf(
    connection_class: type[redis.connection.AbstractConnection],
) -> type[redis.connection.AbstractConnection]:
    """``connection_class`` whose replies of ``MISCONF`` raise :class:`CannotPersist`, the
    connection closed (a pipeline's replies not read yet are dropped with it)."""

    class Connection(connection_class):  # type: ignore[valid-type,misc]
        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_response(*args, **kwargs)
            except redis.ResponseError as exc:
                if not cannot_persist(exc):
                    raise
                self.disconnect()
                raise CannotPersist(CANNOT_PERSIST) from exc

    Connection.__qualname__ = Connection.__name__ = f"RefusingMisconf{connection_class.__name__}"
    return Connection


# Put a message handed back unrun back on its queues (QoS._requeue), each at the end BRPOP
# takes from: only while unacked holds the entry as it was read (ARGV[2], '' : none), else
# nothing (an ack or another restore took it meanwhile: the caller reads again). KEYS: the
# unacked hash, its index, then the lists. ARGV: the delivery tag, the entry read, then what
# each list gets. Returns 1 when done. Flagged allow-oom: it moves a message from unacked to
# its queue, or back to where BRPOP took it, adding nothing. In kombu's MULTI, Redis at its
# maxmemory (noeviction) refused it: a stopping worker's hand-back failed, and the chunk's
# items not started waited for the re-drive.
REQUEUE_SCRIPT = """#!lua flags=allow-oom
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
for i = 3, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[i]) end
return 1
"""


class _Pushes(list[tuple[str, str]]):
    """Stands in for the pipeline kombu's restore pushes a message on: the (list, message)
    pushes it makes, for :data:`REQUEUE_SCRIPT` to make."""

    def rpush(self, key: str, body: str) -> None:
        self.append((key, body))


class QoS(kombu_redis.QoS):
    """kombu's Redis acks, a message handed back put where ``BRPOP`` takes the next one.

    A message the channel's close put back while its task ran on (a broker reconnect) is
    kept in hand (``_restored``) until that task acks or rejects it: handed back then, it goes
    back from the one in hand if ``unacked`` no longer holds it. The copy taken since had
    its delivery tag, and a copy the run's claim refused (a batch chunk's) was acked, which
    took the message from ``unacked``: kombu's requeue, reading ``unacked``, put nothing back,
    and the chunk's items not started were left with no message until the re-drive found
    them lost (``tests/reliability/test_chunk_copies.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # tag -> (the message the close put back while its task ran on, the queues it went to)
        self._restored: dict[str, tuple[dict[str, Any], list[str]]] = {}
        # tag -> (a message taken that Redis refused to record in ``unacked``, its queues)
        self._unrecorded: dict[str, tuple[dict[str, Any], list[str]]] = {}

    def append(self, message: Any, delivery_tag: str) -> None:
        """kombu's record of a message taken (in ``unacked``, a ``MULTI`` of two writes),
        or, on a Redis at its ``maxmemory`` that refuses it, none: the message runs
        unrecorded, as if taken by a worker that dies before its ack (the re-drive sends its
        work again). The ``BRPOP`` has taken it off its queue already; raising, it stopped
        Celery's worker ("Unrecoverable error") and was lost with it.

        An unrecorded message is kept in hand (``_unrecorded``) until it is acked or handed
        back: handed back unrun (``reject(requeue=True)``, a channel's close), it goes back
        from that one, where kombu's requeue and restore, reading ``unacked``, put nothing
        back and its work waited for the re-drive."""
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        except (redis.exceptions.OutOfMemoryError, CannotPersist) as exc:
            log.warning(
                "broker: Redis refused to record message %s taken (%s); it runs unrecorded",
                delivery_tag, exc,
            )  # fmt: skip
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
            info = message.delivery_info
            with contextlib.suppress(Exception):  # as kombu's restore: one it cannot route stays
                queues = self.channel._lookup(info["exchange"], info["routing_key"])
                self._unrecorded[delivery_tag] = (message._raw, queues)

    def ack(self, delivery_tag: str) -> None:
        """kombu's ack, its two deletes sent without ``MULTI``: Redis at its ``maxmemory``
        (``noeviction``) refuses every command queued in a ``MULTI``, deletes too, so the
        ack of a task that ended then raised, and Celery's worker stopped ("Unrecoverable
        error"), its batch items left ``running`` with nothing to run them. Alone, the
        deletes go through. The hash first: a tag left in the index alone is dropped by the
        next ``restore_visible``, which finds no message for it."""
        self._restored.pop(delivery_tag, None)
        self._unrecorded.pop(delivery_tag, None)
        with self.channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            pipe.hdel(self.unacked_key, delivery_tag)
            pipe.zrem(self.unacked_index_key, delivery_tag)
            pipe.execute()
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        restored = self._restored.pop(delivery_tag, None)
        in_hand = self._unrecorded.pop(delivery_tag, None) or restored
        if not requeue:
            super().reject(delivery_tag)  # type: ignore[no-untyped-call]
            return
        self._requeue(delivery_tag, in_hand)  # RPUSH: next taken
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # forget it here

    def _requeue(
        self, tag: str, in_hand: tuple[dict[str, Any], list[str]] | None, client: Any = None
    ) -> None:
        """kombu's ``restore_by_tag``; from ``in_hand`` (the message and its queues, as the
        close or its taking found them) when ``unacked`` has none. One script
        (:data:`REQUEUE_SCRIPT`), which a Redis at its ``maxmemory`` runs too, where kombu's
        ``MULTI`` is refused; read again when ``unacked`` changed meanwhile, as kombu's
        ``WATCH`` had it."""
        with self.channel.conn_or_acquire(client) as client:
            requeue = client.register_script(REQUEUE_SCRIPT)
            while True:
                raw = client.hget(self.unacked_key, tag)
                pushes = self._pushes(raw, in_hand)
                keys = [self.unacked_key, self.unacked_index_key, *(key for key, _ in pushes)]
                if requeue(keys=keys, args=[tag, raw or "", *(body for _, body in pushes)]):
                    return

    def _pushes(
        self, raw: bytes | None, in_hand: tuple[dict[str, Any], list[str]] | None
    ) -> _Pushes:
        """The lists a message handed back goes to, and what is pushed there: the one
        ``unacked`` holds (``raw``) routed as kombu's restore does, else the one in hand."""
        pushes = _Pushes()
        if raw:
            payload, exchange, routing_key = loads(bytes_to_str(raw))  # type: ignore[no-untyped-call]
            self.channel._do_restore_message(payload, exchange, routing_key, pushes, False)
        elif in_hand is not None:  # the channel is closed: its exchanges are looked up no more
            payload, queues = in_hand
            with contextlib.suppress(KeyError):
                payload["headers"]["redelivered"] = True
            priority = self.channel._get_message_priority(payload, reverse=False)
            for queue in queues:
                pushes.rpush(self.channel._q_for_pri(queue, priority), dumps(payload))  # type: ignore[no-untyped-call]
        return pushes

    def restore_unacked(self, client: Any = None) -> None:
        """Every message this channel holds back on its queue, the first taken pushed last:
        taken again first, in the order they were taken (kombu's own reversed that). One
        taken unrecorded goes back from the message in hand, once."""
        for tag, message in self._delivered.items():
            info = message.delivery_info
            with contextlib.suppress(Exception):  # as kombu's restore: one it cannot route stays
                queues = self.channel._lookup(info["exchange"], info["routing_key"])
                self._restored[tag] = (message._raw, queues)
        with self.channel.conn_or_acquire(client) as client:
            for tag in reversed(list(self._delivered)):
                self._requeue(tag, self._unrecorded.pop(tag, None), client)
        self._delivered.clear()


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, still able to reach Redis after its connection was collected,
    with :class:`QoS`."""

    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # computed now, while the transport still holds the connection's URL and credentials
        self._opened_with: dict[str, Any] = super()._connparams()  # type: ignore[no-untyped-call]

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's connection parameters (those it was opened with once its transport has let
        go of the connection), its connections :func:`refusing_misconf`."""
        transport = self.connection
        if transport is None or transport.client is None:  # closed, or its connection collected
            params = dict(self._opened_with)
        else:
            params = super()._connparams(asynchronous)  # type: ignore[no-untyped-call]
        params["connection_class"] = refusing_misconf(params["connection_class"])
        return params


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def broker_transport(broker_url: str) -> str | None:
    """The transport for ``broker_url``: ours for ``redis://`` and ``rediss://``, else None
    (kombu picks).

    kombu sets TLS up from the scheme name ``rediss`` only when it picks its own transport;
    ours takes it from ``broker_use_ssl`` (:func:`broker_ssl`), so a TLS worker rides out a
    Redis restart too (kombu's own exited: "Unrecoverable error")."""
    return TRANSPORT if urlparse(broker_url).scheme in ("redis", "rediss") else None


def broker_ssl(broker_url: str) -> dict[str, str] | None:
    """The broker connection's TLS options (Celery's ``broker_use_ssl``) for ``broker_url``:
    None unless ``rediss://``; else its ``ssl_*`` query parameters, with the certificate
    required unless ``ssl_cert_reqs`` says otherwise.

    That is what redis-py makes of the same URL for the job store and the gateway. Without
    it kombu, given no TLS options, checks no certificate at all (``CERT_NONE``, "defaulting
    to insecure SSL behaviour"): ``rediss://host:6380/0`` was any server to the worker.

    >>> broker_ssl("rediss://redis.internal:6380/0?ssl_ca_certs=/etc/sift/ca.crt")
    {'ssl_cert_reqs': 'required', 'ssl_ca_certs': '/etc/sift/ca.crt'}"""
    parsed = urlparse(broker_url)
    if parsed.scheme != "rediss":
        return None
    query = parse_qs(parsed.query)
    options = {"ssl_cert_reqs": "required"}
    options.update({name: query[name][-1] for name in SSL_PARAMETERS if name in query})
    return options
