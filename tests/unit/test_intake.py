"""ConsumerIntake: only the batch queue's reading paused, in the consumer's event loop, and
given back only where the worker reads it; a real kombu consumer on the memory transport."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.bootsteps import CLOSE, RUN
from celery.worker import state as worker_state
from kombu import Connection, Exchange, Queue

from worker.constants import ALL_QUEUES, BATCH_QUEUE, SEARCH_QUEUE
from worker.queue.base import WorkerContext
from worker.queue.intake import INTAKE, ConsumerIntake


class Hub:
    """The event loop: callbacks wait until :meth:`run` (in any order)."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.ready.append(callback)

    def run(self, reverse: bool = False) -> None:
        ready, self.ready = self.ready, []
        for callback in reversed(ready) if reverse else ready:
            callback()


@pytest.fixture
def app() -> Celery:
    app = Celery("intake-test", set_as_current=False)
    app.conf.task_queues = [
        Queue(name, Exchange(name, type="direct"), routing_key=name) for name in ALL_QUEUES
    ]
    return app


@pytest.fixture
def connection() -> Iterator[Connection]:
    with Connection("memory://") as conn:
        yield conn


def consumer(app: Celery, connection: Connection) -> Any:
    """What the intake reads of Celery's consumer, its task consumer a real kombu one."""
    tasks = app.amqp.TaskConsumer(connection.channel())
    tasks.consume()
    return SimpleNamespace(
        app=app, task_consumer=tasks, hub=Hub(), blueprint=SimpleNamespace(state=RUN)
    )


def reading(c: Any) -> set[str]:
    return {name for name in ALL_QUEUES if c.task_consumer.consuming_from(name)}


def test_pause_stops_only_the_batch_queue_in_the_event_loop_and_resume_reads_it_again(
    app: Celery, connection: Connection
) -> None:
    c = consumer(app, connection)
    intake = ConsumerIntake()
    intake.attach(c)
    c.hub.run()  # a fresh consumer, not paused: nothing changes
    assert reading(c) == set(ALL_QUEUES)
    intake.pause()
    assert reading(c) == set(ALL_QUEUES)  # not from this thread: in the event loop
    c.hub.run()
    assert reading(c) == set(ALL_QUEUES) - {BATCH_QUEUE}
    intake.resume()
    intake.resume()
    c.hub.run()
    assert reading(c) == set(ALL_QUEUES)  # added once
    assert list(c.task_consumer.queues).count(app.amqp.queues[BATCH_QUEUE]) == 1


def test_callbacks_run_in_any_order_leave_the_state_last_asked(
    app: Celery, connection: Connection
) -> None:
    c = consumer(app, connection)
    intake = ConsumerIntake()
    intake.attach(c)
    intake.pause()
    intake.resume()
    c.hub.run(reverse=True)
    assert BATCH_QUEUE in reading(c)
    intake.pause()
    intake.resume()
    intake.pause()
    c.hub.run(reverse=True)
    assert reading(c) == set(ALL_QUEUES) - {BATCH_QUEUE}


def test_a_consumer_after_a_reconnect_is_paused_again_and_resumed_once(
    app: Celery, connection: Connection
) -> None:
    intake = ConsumerIntake()
    old = consumer(app, connection)
    intake.attach(old)
    intake.pause()
    old.hub.run()
    fresh = consumer(app, connection)  # starts on every selected queue
    intake.attach(fresh)
    fresh.hub.run()
    assert reading(fresh) == set(ALL_QUEUES) - {BATCH_QUEUE}
    intake.resume()
    fresh.hub.run()
    assert reading(fresh) == set(ALL_QUEUES)


def test_a_queue_the_worker_was_not_started_with_is_never_added(
    app: Celery, connection: Connection
) -> None:
    app.amqp.queues.select([SEARCH_QUEUE])  # celery worker -Q sift.search
    c = consumer(app, connection)
    intake = ConsumerIntake()
    intake.attach(c)
    intake.pause()
    intake.resume()
    c.hub.run()
    assert reading(c) == {SEARCH_QUEUE}


def test_nothing_is_added_while_the_worker_stops(
    app: Celery, connection: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = consumer(app, connection)
    intake = ConsumerIntake()
    intake.attach(c)
    intake.pause()
    c.hub.run()
    monkeypatch.setattr(worker_state, "should_stop", 0)  # SIGTERM: a warm shutdown, exit 0
    intake.resume()
    c.hub.run()
    assert BATCH_QUEUE not in reading(c)
    monkeypatch.setattr(worker_state, "should_stop", None)
    c.blueprint.state = CLOSE  # the consumer stopping
    intake.resume()
    c.hub.run()
    assert BATCH_QUEUE not in reading(c)
    c.task_consumer = None  # shut down
    intake.pause()
    c.hub.run()  # nothing to change, no error


def test_without_a_consumer_or_an_event_loop_it_does_nothing(
    app: Celery, connection: Connection
) -> None:
    intake = ConsumerIntake()
    intake.pause()
    intake.resume()
    c = consumer(app, connection)
    c.hub = None
    intake.attach(c)
    intake.pause()
    assert reading(c) == set(ALL_QUEUES)


class RunningHub(Hub):
    """An event loop running each callback as it is handed one (as a woken loop does)."""

    def call_soon(self, callback: Callable[[], None]) -> None:
        callback()


def elsewhere(call: Callable[[], bool]) -> bool:
    """``call`` from a thread not the event loop's (the test's own, which attached the
    consumer, plays the loop's): the hand-back thread's, or a task's on the threads pool."""
    with ThreadPoolExecutor(1) as other:
        return other.submit(call).result()


def test_a_stop_cancels_every_queue_before_it_returns_and_nothing_is_read_again(
    app: Celery, connection: Connection
) -> None:
    """A stopping process takes no message of any queue from the moment ``stop_taking``
    returns (what it hands back after cannot come back to it), and no resume reads one again,
    before Celery's own stop flag is set too."""
    c = consumer(app, connection)
    c.hub = RunningHub()
    intake = ConsumerIntake()
    intake.attach(c)
    assert not intake.stopping
    assert elsewhere(intake.stop_taking) and intake.stopping
    assert reading(c) == set()
    intake.resume()
    assert reading(c) == set()
    assert elsewhere(intake.stop_taking)  # again: the same cancel, done


def test_a_stop_waits_for_the_event_loop_to_cancel(app: Celery, connection: Connection) -> None:
    """Until the event loop runs the cancel, nothing is cancelled (no thread but the loop's
    touches the consumer) and the wait ends unanswered at its timeout."""
    c = consumer(app, connection)
    intake = ConsumerIntake()
    intake.attach(c)
    assert not elsewhere(lambda: intake.stop_taking(timeout=0))
    assert reading(c) == set(ALL_QUEUES)
    c.hub.run()
    assert reading(c) == set()
    assert elsewhere(lambda: intake.stop_taking(timeout=0))


def test_a_stop_in_the_event_loop_s_thread_cancels_there(
    app: Celery, connection: Connection
) -> None:
    """The ``solo`` pool runs a task in the event loop's thread, which runs no callback until
    the task returns: a chunk's hand-back there cancels the consumer itself. It waited for the
    loop, its whole timeout (2 s) on every chunk handed back."""
    c = consumer(app, connection)
    intake = ConsumerIntake()
    intake.attach(c)  # from the thread that runs its event loop: this one
    assert intake.stop_taking(timeout=0)
    assert reading(c) == set()
    c.hub.run()  # the loop's turn once the task returns: nothing left to cancel, no error
    assert reading(c) == set()


def test_an_item_queue_made_once_the_stop_began_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that ran no batch chunk before its stop has no item queue to close then: a
    chunk it took as the stop began makes one, closed, and goes back at once, where it ran to
    its end (a 429's pause included) and held the stop."""
    settings = SimpleNamespace(batch_item_concurrency=2)
    running = WorkerContext(settings=settings, store=None, limiter=None)  # type: ignore[arg-type]
    assert not running.items.stopping()
    monkeypatch.setattr(INTAKE, "_stopping", True)
    stopping = WorkerContext(settings=settings, store=None, limiter=None)  # type: ignore[arg-type]
    assert stopping.items.stopping()
