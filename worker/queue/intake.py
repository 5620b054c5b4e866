"""Whether a worker process takes batch chunks from the broker while its batch items queue up.

Celery's consumer takes messages while fewer than its prefetch count (one per thread: 300)
are unacked, and a chunk task holds its message until its items are done; so the first
process to poll takes most of a large batch's chunks, and at the end it still has hundreds
of items queued while another process idles (measured: 650 against 1,350 items of a
2,000-query batch between two processes). :class:`ConsumerIntake` stops the consumer
reading the batch queue (:data:`~worker.constants.BATCH_QUEUE`) while the process's item
queue holds a pool's worth of items not yet started, and reads it again once half of them
have started (:class:`worker.queue.items.ItemQueue` decides when): the rest of the batch's
chunks stay in Redis for whichever process has room.

Only that queue pauses: searches, index reads, ingests and webhooks flow on, and the
prefetch count is never touched. What the pause delays in this process is what the batch
queue carries: batch chunks, and the economy tasks routed there (submit and poll of
provider batches), which another process with room takes meanwhile. (Their cancel goes on
the search queue: it must not wait behind batches.)

Celery's consumer is not thread-safe, so a change is applied in its event loop
(``hub.call_soon``, which takes a lock and wakes the loop). The callback reads the wanted
state when it runs, so callbacks run in any order or twice leave the queue as last asked.
It never adds a queue the worker was not started with (``-Q``), nor one an operator
cancelled (both leave it out of the app's selected queues), nor any while the worker
stops. A consumer after a reconnect starts on every selected queue; attaching it applies
the wanted state again.

A stopping process takes no message at all (:meth:`ConsumerIntake.stop_taking`): its
consumer is cancelled on every queue before any message is handed back. Celery's warm
shutdown only sets a flag that the event loop reads at its next turn, and the turn already
under way delivers what its poll returns: a chunk the process (or its sibling, stopping
beside it) handed back at once came back to it, and ran there to its end, a 429's pause
included. The ``solo`` pool runs a task in the event loop's own thread: a chunk's hand-back
there cancels the consumer itself, as the loop cannot turn until the task returns.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps
from celery.bootsteps import RUN
from celery.worker import state as worker_state

from worker.constants import BATCH_QUEUE

log = logging.getLogger(__name__)

# How long a stop waits for its consumer to be cancelled before it hands anything back: the
# event loop runs the cancel as soon as it wakes, or the warm shutdown's consumer stop does.
STOP_TAKING_WAIT_SECONDS = 2.0


class ConsumerIntake:
    """The process's Celery consumer, its reading of ``queue`` paused and resumed. ``pause``
    and ``resume`` come one at a time (the item queue's lock), from any thread."""

    def __init__(self, queue: str = BATCH_QUEUE) -> None:
        self._queue = queue
        self._consumer: Any = None
        self._paused = False  # what the item queue asked for last
        self._stopping = False  # the worker is stopping: take no more messages
        self._stopped = threading.Event()  # ...and the consumer has been cancelled
        self._loop_thread: int | None = None  # the thread that runs the consumer's event loop

    def attach(self, consumer: Any) -> None:
        """Follow ``consumer``, from the thread that then runs its event loop (its bootstep's
        start)."""
        self._consumer = consumer
        self._loop_thread = threading.get_ident()
        self._schedule()  # a consumer after a reconnect reads every queue: pause it again

    def pause(self) -> None:
        self._paused = True
        self._schedule()

    def resume(self) -> None:
        self._paused = False
        self._schedule()

    @property
    def stopping(self) -> bool:
        """Whether the worker's stop has begun (:meth:`stop_taking` was called)."""
        return self._stopping

    def stop_taking(self, timeout: float = STOP_TAKING_WAIT_SECONDS) -> bool:
        """The worker is stopping: its consumer takes no more messages, of any queue. Waits
        (up to ``timeout``) until the event loop has cancelled it, so that what the process
        hands back after this cannot come back to it; True once it has. Called again, it
        waits for the same cancel. Called in the event loop's thread (a task of the ``solo``
        pool), it cancels it there and then: the loop runs nothing until the task returns.
        Without an event loop, no message was taken: True."""
        self._stopping = True
        hub = getattr(self._consumer, "hub", None)
        if hub is None:
            return True
        if threading.get_ident() == self._loop_thread:
            self.cancel_all()
        elif not self._stopped.is_set():
            hub.call_soon(self.cancel_all)
        return self._stopped.wait(timeout)

    def cancel_all(self) -> None:
        """In the consumer's event loop (or its stop): cancel its consumer on every queue,
        once. A message a poll already under way returns is then put back by kombu (no
        consumer for its queue), not delivered."""
        if self._stopped.is_set():
            return
        try:
            tasks = getattr(self._consumer, "task_consumer", None)
            if tasks is not None:
                tasks.cancel()
                log.info("stopped taking tasks: the worker is stopping")
        except Exception:  # Celery's own stop cancels it too: never stop the event loop
            log.warning("the consumer was not cancelled at the stop", exc_info=True)
        finally:
            self._stopped.set()

    def _schedule(self) -> None:
        hub = getattr(self._consumer, "hub", None)
        if hub is not None:  # without an event loop, no thread may touch the consumer
            hub.call_soon(self.apply)

    def apply(self) -> None:
        """In the consumer's event loop: read the queue or not, as last asked."""
        consumer = self._consumer
        tasks = getattr(consumer, "task_consumer", None)
        if tasks is None:  # not started, or shut down
            return
        try:
            reading = tasks.consuming_from(self._queue)
            if self._paused and reading:
                tasks.cancel_by_queue(self._queue)
                log.info("stopped reading %s: a pool's worth of batch items wait", self._queue)
            elif not self._paused and not reading and self._may_read(consumer):
                tasks.add_queue(consumer.app.amqp.queues[self._queue])
                tasks.consume()
                log.info("reading %s again", self._queue)
        except Exception:  # only a balance between processes: never stop the event loop
            log.warning("the batch queue's intake was not changed", exc_info=True)

    def _may_read(self, consumer: Any) -> bool:
        """The worker reads the queue (selected: not left out by ``-Q`` or cancelled by an
        operator) and is not stopping."""
        if self._stopping or _stopping():
            return False
        if getattr(consumer.blueprint, "state", None) != RUN:
            return False
        return self._queue in consumer.app.amqp.queues.consume_from


def _stopping() -> bool:
    """Whether Celery's warm or cold shutdown flag is set (an exit code once set, 0 included)."""
    flags = worker_state.should_stop, worker_state.should_terminate
    return any(flag is not None and flag is not False for flag in flags)


INTAKE = ConsumerIntake()  # the process's one consumer


class IntakeStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer bootstep: :data:`INTAKE` follows the consumer (again after a reconnect)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        INTAKE.attach(c)

    def stop(self, c: Any) -> None:
        """The consumer stops: at the worker's stop, this releases a hand-back waiting in
        :meth:`ConsumerIntake.stop_taking` if the event loop ended before it ran the cancel
        (Celery's Tasks step, stopped after this one, cancels the consumer all the same). A
        reconnect's restart stops it too, and changes nothing."""
        if INTAKE.stopping or _stopping():
            INTAKE.cancel_all()
