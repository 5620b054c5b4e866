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

``celery_config`` selects this transport for ``redis://`` broker URLs; every other scheme keeps
kombu's own. ``tests/reliability/test_broker_restart.py`` restarts Redis under a worker;
``tests/integration/test_broker.py`` checks both the close and the order, and
``tests/integration/test_batch_order.py`` the order over real workers.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

TRANSPORT = "worker.queue.broker:Transport"


class QoS(kombu_redis.QoS):
    """kombu's Redis acks, a message handed back put where ``BRPOP`` takes the next one."""

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:
            super().reject(delivery_tag)  # type: ignore[no-untyped-call]
            return
        self.restore_by_tag(delivery_tag)  # type: ignore[no-untyped-call]  # RPUSH: next taken
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # forget it here

    def restore_unacked(self, client: Any = None) -> None:
        """Every message this channel holds back on its queue, the first taken pushed last:
        taken again first, in the order they were taken (kombu's own reversed that)."""
        with self.channel.conn_or_acquire(client) as client:
            for tag in reversed(list(self._delivered)):
                self.restore_by_tag(tag, client=client)  # type: ignore[no-untyped-call]
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
        transport = self.connection
        if transport is None or transport.client is None:  # closed, or its connection collected
            return dict(self._opened_with)
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[no-untyped-call]
        return params


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def broker_transport(broker_url: str) -> str | None:
    """The transport for ``broker_url``: ours for ``redis://``, else None (kombu picks).

    ``rediss://`` is left to kombu: it sets TLS up from that scheme name only."""
    return TRANSPORT if urlparse(broker_url).scheme == "redis" else None
