"""How many messages a worker process takes from the broker while its batch items queue up.

Celery's consumer takes messages while fewer than its prefetch count (one per thread: 300)
are unacked, and a chunk task holds its message until its items are done; so the first
process to poll takes most of a large batch's chunks, and at the end it still has hundreds
of items queued while another process idles (measured: 650 against 1,350 items of a
2,000-query batch between two processes). :class:`ConsumerIntake` pauses the consumer (its
prefetch count down to 1, which ``can_consume`` then refuses) while the process's item
queue holds a pool's worth of items not yet started, and gives the count back once half
of them have started (:class:`worker.queue.items.ItemQueue` decides when): the rest of the
batch's chunks stay in Redis for whichever process has room. A paused process takes no
search either; it had no room for one.

Celery applies a changed count in its event loop, which a resume wakes (``hub.call_soon``);
the process resumes at half a pool's worth, not when its queue is empty, so it has work
while the loop comes round and the next messages arrive.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps


class ConsumerIntake:
    """The process's Celery consumer, paused and resumed through its prefetch count. Calls
    come one at a time (the item queue's lock), from any thread: kombu's ``QoS`` takes
    its own lock, and Celery's event loop applies the change."""

    def __init__(self) -> None:
        self._consumer: Any = None
        self._held: tuple[Any, int] | None = None  # (the QoS paused, by how much)

    def attach(self, consumer: Any) -> None:
        self._consumer = consumer

    def pause(self) -> None:
        qos = getattr(self._consumer, "qos", None)
        if qos is None or self._held is not None:
            return
        by = max(0, int(qos.value) - 1)
        if by:
            qos.decrement_eventually(by)
            self._held = (qos, by)

    def resume(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        paused, by = held
        current: Any = getattr(self._consumer, "qos", None)
        if current is not None and current is paused:  # not a new one (after a reconnect)
            current.increment_eventually(by)
            # wake the event loop, which may be polling with nothing to read for up to 10 s
            # (its next timer): it applies the count when it next goes round
            hub = getattr(self._consumer, "hub", None)
            if hub is not None:
                hub.call_soon(_go_round)


def _go_round() -> None:
    """Nothing: scheduled only to wake Celery's event loop."""


INTAKE = ConsumerIntake()  # the process's one consumer


class IntakeStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer bootstep: :data:`INTAKE` follows the consumer (again after a reconnect)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        INTAKE.attach(c)
