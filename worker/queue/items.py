"""The batch items a worker process runs: one queue across its chunks, worked by its item pool.

A chunk task puts its items on the process's queue, submits one runner per item to the
item pool (``SIFT_BATCH_ITEM_CONCURRENCY`` threads), and waits until each of its items is
done. A runner takes items off the queue, whichever chunk they come from, until none is
left, so a thread runs items back to back: the job-store transition that finishes one and
the one that starts the next go in one round trip. A runner that finds the queue empty ends
at once.

An item taken but not started is still cancelable: its start reads the batch's cancel mark
in the same script (no round trip more), and one whose batch was canceled is canceled
instead of started (unless its run claim kept the model's answer: past its model call, it
finishes on that answer). ``run`` may cancel a started item the same way (before its model call)
and answer that transition. A start is refused while another live run holds the item's run
claim (:mod:`worker.queue.jobstore.runs`), or once its economy first half is kept: that run
(or its provider batch) finishes it, and a copy of its chunk leaves it as it is (not moved,
not canceled under a run in its model call or a request the provider processed).

When the worker is told to stop (SIGTERM), :meth:`ItemQueue.hand_back` closes the queue:
items not yet started go back to their chunks as ``handed_back``, and each chunk task hands
its message back to the broker at once (``Reject(requeue=True)``) for another worker. An item
started but not yet at its model call (waiting for the rate budget, in its pacing or for its
reservation; in its retrieval), or waiting before a retry of calls that read no token (a
429's ``retry-after``, the provider's outage), reads :meth:`ItemQueue.stopping` and goes back
the same way, queued again (:mod:`worker.queue.tasks`; running, keeping those calls): under
a budget paced to the provider's limit most of a batch waits there, and held the stop up to
the stop deadline. Only the items already in their model call run to their end here.

    queue = ItemQueue(store, ThreadPoolExecutor(300))
    outcomes = queue.run(Chunk(batch_id, to_start, run, finished), pending_items)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

from worker.contract import ErrorInfo, SearchResult
from worker.observability.logcontext import job_context
from worker.queue.jobstore import BatchItem, ItemTransition, JobStore
from worker.runtime.slots import behind_searches

log = logging.getLogger(__name__)

# What running one item came to: the result or the error to finish it with, "retry"
# (requeued for the chunk's retry), "handed_back" (requeued: its worker is stopping, and it
# had sent nothing), the transition that canceled it (its batch was canceled before its
# model call; already in the store), or None (nothing to finish now).
RunOutcome = (
    tuple[SearchResult, None]
    | tuple[None, ErrorInfo]
    | ItemTransition
    | Literal["retry", "handed_back"]
    | None
)


@dataclass
class Chunk:
    """One chunk task's items: how to start, run and account for each.

    ``to_start`` answers the query id to start (None: run it unstarted, or skip it);
    ``run`` runs an item, told whether it started; ``finished`` hears of each finish
    transition (with its item), and of each cancel (``canceled`` set) of an item its batch's
    cancel mark stopped. ``outcomes`` collects (batch completed, to retry) per item; ``error`` is
    what broke a runner, if anything did; ``handed_back`` counts the items not run because
    the worker is stopping. ``claimant``: the worker id and lease its items' runs claim
    with, by which their starts judge an item's run claim as the claim would."""

    batch_id: str
    to_start: Callable[[BatchItem], str | None]
    run: Callable[[BatchItem, bool], RunOutcome]
    finished: Callable[[BatchItem, ItemTransition, ErrorInfo | None], None]
    claimant: tuple[str, float] = ("", 0.0)
    outcomes: list[tuple[bool, bool]] = field(default_factory=list, init=False)
    error: BaseException | None = field(default=None, init=False)
    handed_back: int = field(default=0, init=False)
    _left: int = field(default=0, init=False)
    _done: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def expect(self, items: int) -> None:
        self._left = items
        if items == 0:
            self._done.set()

    def wait(self) -> None:
        self._done.wait()

    def record(self, batch_completed: bool, retry: bool) -> None:
        with self._lock:
            self.outcomes.append((batch_completed, retry))
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def fail(self, error: BaseException) -> None:
        """An item's runner broke (the job store unreachable past its retries, say)."""
        with self._lock:
            self.error = self.error or error
        self.record(False, False)

    def hand_back(self) -> None:
        """An item not run (not started, or stopped before its model call): the worker is
        stopping, the chunk's message goes back."""
        with self._lock:
            self.handed_back += 1
        self.record(False, False)


Entry = tuple[Chunk, BatchItem]

# How stale this process's view of a batch's cancel mark may be before an item about to make
# its model call reads it again: a cancel reaches the items of a process this much later at
# most, and the hundreds of items in flight share one read per batch per period.
CANCEL_MARK_MAX_AGE_SECONDS = 0.1
_MARKS_KEPT = 1_000  # batches remembered before the oldest views are dropped


class CancelMarks:
    """Which batches have been canceled, as this process last read it: a view at most
    :data:`CANCEL_MARK_MAX_AGE_SECONDS` old, read again by one thread while the others that
    need it wait for that read. A mark once seen stays: a cancel is never undone.

    marks = CancelMarks(store)
    if marks.canceled(batch_id):
        store.check_item(batch_id, query_id)  # cancels the item, atomically
    """

    def __init__(
        self,
        store: JobStore,
        max_age: float = CANCEL_MARK_MAX_AGE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._max_age = max_age
        self._clock = clock
        self._seen: dict[str, tuple[float, bool]] = {}  # batch id -> (read at, canceled)
        self._reading: dict[str, Future[bool]] = {}  # batch id -> the read in progress
        self._lock = threading.Lock()

    def canceled(self, batch_id: str) -> bool:
        now = self._clock()
        with self._lock:
            read_at, canceled = self._seen.get(batch_id, (float("-inf"), False))
            if canceled or now - read_at < self._max_age:
                return canceled
            reading = self._reading.get(batch_id)
            if reading is None:
                reading = self._reading[batch_id] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return reading.result()
        try:
            canceled = self._store.batch_canceled(batch_id)
        except BaseException as exc:
            with self._lock:
                del self._reading[batch_id]
            reading.set_exception(exc)
            raise
        with self._lock:
            if len(self._seen) >= _MARKS_KEPT:
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < 60}
            self._seen[batch_id] = (now, canceled)
            del self._reading[batch_id]
        reading.set_result(canceled)
        return canceled


class Intake(Protocol):
    """The process's reading of the batch queue (:class:`worker.queue.intake.ConsumerIntake`)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ItemQueue:
    """The process's queue of batch items (see the module doc).

    With an ``intake``, the process reads no more of the batch queue while ``high`` items or
    more wait unstarted, until half of them have started: another process takes the batch's
    other chunks (:mod:`worker.queue.intake`); its other queues flow on."""

    def __init__(
        self, store: JobStore, pool: ThreadPoolExecutor, intake: Intake | None = None, high: int = 0
    ) -> None:
        self._store = store
        self._pool = pool
        self._queue: deque[Entry] = deque()  # append and popleft need no lock
        self._closed = False
        self._intake = intake
        self._high = max(2, high)
        self._paused = False
        self._intake_lock = threading.Lock()
        self._running = 0  # items in ``chunk.run`` now
        self._running_lock = threading.Lock()

    def _check_intake(self) -> None:
        """Pause the intake at ``high`` items waiting, resume it at half that."""
        if self._intake is None:
            return
        waiting = len(self._queue)
        if waiting >= self._high // 2 if self._paused else waiting < self._high:
            return  # the common case: nothing to change, no lock taken
        with self._intake_lock:
            waiting = len(self._queue)
            try:
                if not self._paused and waiting >= self._high:
                    self._paused = True
                    self._intake.pause()
                elif self._paused and waiting < self._high // 2:
                    self._paused = False
                    self._intake.resume()
            except Exception:  # only a balance between processes: never an item's failure
                log.warning("the broker intake was not changed", exc_info=True)

    def run(self, chunk: Chunk, items: list[BatchItem]) -> Chunk:
        """Run ``items`` on the pool and wait for each; answers the chunk, its ``outcomes``
        and its ``error`` (what broke a runner) filled in."""
        chunk.expect(len(items))
        self._queue.extend((chunk, item) for item in items)
        self._check_intake()
        for _ in items:
            self._pool.submit(self._work)
        if self._closed:  # came in while the queue was being handed back
            self.hand_back()
        chunk.wait()
        return chunk

    def hand_back(self) -> None:
        """The worker is stopping: start no more items; each one waiting goes back to its
        chunk as handed back. Items already started run to their end."""
        self._closed = True
        while (entry := self._pop()) is not None:
            entry[0].hand_back()

    def running(self) -> int:
        """How many items are in their run now: at a stop, those in their model call (the
        others go back), which the stop waits for; the stop deadline's line names them."""
        return self._running

    def _count_running(self, change: int) -> None:
        with self._running_lock:
            self._running += change

    def stopping(self) -> bool:
        """Whether the worker is stopping (:meth:`hand_back` was called): an item started
        and not yet at its model call goes back then, as one not started does."""
        return self._closed

    def _take(self) -> Entry | None:
        entry = None if self._closed else self._pop()
        self._check_intake()
        return entry

    def _pop(self) -> Entry | None:
        try:
            return self._queue.popleft()
        except IndexError:
            return None

    @staticmethod
    def _start_of(entry: Entry | None) -> tuple[str, str] | None:
        """(batch id, query id) to start for ``entry``; None when it runs unstarted."""
        if entry is None:
            return None
        chunk, item = entry
        query_id = chunk.to_start(item)
        return None if query_id is None else (chunk.batch_id, query_id)

    def _begin(self, entry: Entry | None) -> ItemTransition | None:
        """Start ``entry``'s item (None: it runs unstarted); the transition says whether it
        started, or was canceled instead."""
        start = self._start_of(entry)
        if entry is None or start is None:
            return None
        return self._store.begin_item(*start, claimant=entry[0].claimant)

    @staticmethod
    def _finished(
        chunk: Chunk, item: BatchItem, transition: ItemTransition, error: ErrorInfo | None
    ) -> None:
        """Tell ``chunk`` of the item's finish (its figures are recorded once it is saved;
        its lines carry the item's id), then account for the item. The chunk's task wakes
        once its last item is accounted for and reads what the finishes left (the claims of
        runs that ended without one), so each finish is heard first: accounted for first, a
        thread switch between the two had the task read them while the finish changed them."""
        try:
            with job_context(f"{chunk.batch_id}/{item.query_id}"):
                chunk.finished(item, transition, error)
        finally:
            chunk.record(transition.batch_completed, False)

    def _work(self) -> None:
        """Run items until the queue is empty, each waiting for its CPU slot behind the
        searches (:func:`~worker.runtime.slots.behind_searches`)."""
        with behind_searches():
            self._run_items()

    def _run_items(self) -> None:
        """What breaks a runner fails the chunk of the item it was running (if that item is
        not yet accounted for); an item it had taken but not run goes back for another
        runner."""
        current = self._take()  # the item being run, until it is accounted for
        taken: Entry | None = None  # the next one, off the queue
        try:
            begun = self._begin(current)
            while current is not None:
                chunk, item = current
                outcome: RunOutcome
                if begun is not None and begun.canceled:
                    outcome = begun  # its batch was canceled: canceled, not started
                else:
                    self._count_running(1)
                    try:
                        with job_context(f"{chunk.batch_id}/{item.query_id}"):
                            outcome = chunk.run(item, begun is not None and begun.started)
                    finally:
                        self._count_running(-1)
                taken = self._take()
                if isinstance(outcome, ItemTransition):  # canceled; the store has it already
                    current = None
                    self._finished(chunk, item, outcome, None)
                    begun = self._begin(taken)
                elif outcome == "handed_back":  # requeued already: the worker is stopping
                    current = None
                    chunk.hand_back()
                    begun = self._begin(taken)
                elif outcome is None or outcome == "retry":
                    chunk.record(False, outcome == "retry")
                    current = None
                    begun = self._begin(taken)
                else:
                    result, error = outcome
                    # the finish and the next start, in one round trip
                    transition, begun = self._store.finish_and_start_item(
                        chunk.batch_id,
                        item.query_id,
                        result=result,
                        error=error,
                        start=self._start_of(taken),
                        claimant=taken[0].claimant if taken is not None else ("", 0.0),
                    )
                    current = None
                    self._finished(chunk, item, transition, error)
                current, taken = taken, None
        except BaseException as exc:
            log.exception("batch item runner broke")
            if current is not None:
                current[0].fail(exc)
            if taken is not None:
                self._queue.appendleft(taken)
                self._pool.submit(self._work)
                if self._closed:
                    self.hand_back()
