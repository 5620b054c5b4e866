"""One run of each economy task at a time: the lease a run holds while its process lives
(kept alive by a :class:`_Keeper` thread per process), the run's marks that renew it and
move its watch (:func:`expect`), and its handing over to the task's next message."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

from worker import clock
from worker.constants import ECONOMY_SENDING_MARK, ECONOMY_STATE_KEY
from worker.queue import liveness
from worker.queue.base import SiftTask
from worker.queue.jobstore import JobStore

log = logging.getLogger(__name__)


# Each submission and poll says by when it should run next (its countdown plus this margin:
# a worker's death and restore, a long mapping between its marks). One not run by then lost
# its message (the broker's pop-then-record window; a retry not published during a Redis
# outage): the re-drive's sweep sends it again (:func:`rewake`).
WATCH_MARGIN_SECONDS = 300.0


class _StoodDown(Exception):
    """Another run of this economy task took its lease over: this one stops where it is."""


_RUN = threading.local()  # the lease of the economy run this thread is in: (batch, what, holder)


class _Keeper:
    """Keeps the leases of this process's economy runs alive, from a thread of its own, for
    ``SIFT_WORKER_DEAD_AFTER_SECONDS`` at a time, renewed every heartbeat: a lease lives as
    long as the process running it, not as long as its worker's heartbeat. Under the prefork
    pool the children share their supervisor's heartbeat, so a child killed alone left its
    lease looking alive for the lease's whole term (300 s), and its redelivered run stood
    down; now that lease lapses within seconds, and the redelivered run, waiting for it
    (:func:`leased`), takes it over. A run stuck past its watch's margin since its last
    mark is let go (its lease lapses, as a lease with no keeper did); that time is measured
    on the monotonic clock, which no step of the wall clock moves (an NTP correction, a VM
    resumed: a wall clock stepped 5 minutes on let every live run's lease lapse). A fork
    (a prefork child) starts a keeper of its own: threads do not survive it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # lease -> when its run last marked (monotonic), its store, how long it lives unrenewed
        self.held: dict[tuple[str, str, str], tuple[float, JobStore, float]] = {}
        self.pid = 0

    def keep(self, task: SiftTask, lease: tuple[str, str, str]) -> None:
        """Keep ``lease`` alive from now on (the run marked, or took it)."""
        with self.lock:
            if self.pid != os.getpid():
                self.pid, self.held = os.getpid(), {}
                every = task.context.settings.worker_heartbeat_seconds
                threading.Thread(target=self._run, args=(every,), name="sift-economy-leases",
                                 daemon=True).start()  # fmt: skip
            self.held[lease] = (time.monotonic(), task.context.store, _lease_seconds(task))

    def drop(self, lease: tuple[str, str, str]) -> None:
        with self.lock:
            self.held.pop(lease, None)

    def _run(self, every: float) -> None:
        while True:
            time.sleep(every)
            self.renew()

    def renew(self) -> None:
        """Renew every lease held, once; let go of a run's that has not marked for longer
        than its watch's margin (stuck)."""
        with self.lock:
            leases = list(self.held.items())
        for lease, (marked, store, seconds) in leases:
            batch_id, what, holder = lease
            try:
                kept = time.monotonic() - marked < WATCH_MARGIN_SECONDS and store.economy_lease(
                    batch_id, what, holder, seconds, renew=True
                )
            except Exception:  # Redis away: the run's own next mark will tell
                log.debug("economy lease %s %s: not renewed", batch_id, what, exc_info=True)
                continue
            if not kept:
                self.drop(lease)


_KEEPER = _Keeper()


def _lease_seconds(task: SiftTask) -> float:
    """How long a lease lives unrenewed: as long as a silent worker is taken for alive."""
    return float(task.context.settings.worker_dead_after_seconds)


def leased(task: SiftTask, batch_id: str, what: str, run: Callable[[], None]) -> None:
    """Run the economy task for ``what`` as the one run of it under way. Two runs of one task
    can overlap: the same message delivered again while its run goes on (kombu restores it
    once the visibility timeout passes), or the watch's re-send of a run whose create or
    results page took longer than its margin. Each would map the same results and resubmit
    the same items, or settle the other's create as in doubt and make the items' provider
    batch again. So a run holds a lease (its worker id and a token), kept alive while its
    process lives (:class:`_Keeper`): a second run finding it held by a live worker waits
    for it as long as a lease lives unrenewed (a holder that died lets it lapse by then),
    then stands down; and the holder's own marks (each create, each piece of a create's
    body, each results page: :func:`expect`) renew it, so a holder whose lease was taken
    over (its worker judged dead: its heartbeat gone, or its process stalled) stands down at
    its next mark, even if the lease is free again by then. The run under way
    keeps the task's watch, which sends it again should it die with nothing else to follow.
    A batch gone (its record erased by ``sift tenant purge``) gives no lease: the run does
    not start."""
    store = task.context.store
    beat = liveness.current()
    holder = f"{beat.worker_id if beat else ''} {uuid.uuid4().hex}"
    seconds = _lease_seconds(task)
    every = float(task.context.settings.worker_heartbeat_seconds)
    give_up = time.monotonic() + seconds + every
    while not store.economy_lease(batch_id, what, holder, seconds):
        if store.get_batch(batch_id) is None:  # erased (sift tenant purge), or expired
            store.economy_met(batch_id, what)
            log.info("batch %s: gone; its %s task has nothing to do", batch_id, what)
            return
        if time.monotonic() >= give_up:
            log.info("batch %s: another run of its %s task is under way; this one stands down",
                     batch_id, what)  # fmt: skip
            return
        time.sleep(every)
    lease = (batch_id, what, holder)
    _RUN.lease = lease
    _KEEPER.keep(task, lease)
    try:
        run()
    except _StoodDown:
        if store.get_batch(batch_id) is None:  # its lease refused: the batch was erased
            log.warning("batch %s: erased while its %s task ran; the run stopped", batch_id, what)
        else:
            log.warning("batch %s: another run took its %s task over; this one stopped",
                        batch_id, what)  # fmt: skip
    finally:
        _RUN.lease = None
        _KEEPER.drop(lease)
        store.economy_unlease(batch_id, what, holder)


def expect(
    task: SiftTask, batch_id: str, what: str, countdown: float, *, sending: str | None = None
) -> None:
    """The economy task for ``what`` (a provider batch, or the submission) runs again within
    ``countdown`` seconds, or its message was lost (:func:`rewake`). A mark of the run under
    way (``countdown`` 0) also renews its lease, or stops it if another run took it over; a
    later one (its retry's, or a new message's, countdown) gives the lease back.
    ``sending``: the mark is the guard of a piece of that submission's create body
    (:func:`upload_guard`), and the time is kept with the lease, under the same check."""
    store = task.context.store
    lease: tuple[str, str, str] | None = getattr(_RUN, "lease", None)
    holder = lease[2] if lease is not None and lease[:2] == (batch_id, what) else None
    renew = countdown == 0.0 and holder is not None
    mark = None if sending is None else (ECONOMY_SENDING_MARK + sending, repr(clock.now()))
    if renew and not store.economy_lease(
        batch_id, what, str(holder), _lease_seconds(task), renew=True, resume=True, mark=mark
    ):
        raise _StoodDown(what)
    if renew and lease is not None:
        _KEEPER.keep(task, lease)  # marked: not stuck
    if mark is not None and not renew:
        store.economy_save(batch_id, ECONOMY_STATE_KEY, {mark[0]: mark[1]})
    # on the shared clock: the sweep that judges it lost may run on another host
    store.economy_expect(batch_id, what, clock.now() + countdown + WATCH_MARGIN_SECONDS)
    if countdown > 0.0:
        give_back(task, batch_id, what)


def upload_guard(task: SiftTask, batch_id: str, what: str, submission: str) -> Callable[[], None]:
    """The guard of a create's upload, run before each piece of its body goes out
    (:meth:`AnthropicMessageBatches.create`'s ``before_write``). The run's lease is renewed,
    or the upload stops short of its end (taken over: the new run may send the same requests
    again, and this create, completed after all, would be a second provider batch, paid
    twice); and the time is marked, in the same step, as the latest at which this create's
    body could have been completed: :func:`settle_doubts` waits the doubt window past it,
    and looks for its batch up to then, not only the window past the create's start."""
    return lambda: expect(task, batch_id, what, 0.0, sending=submission)


def give_back(task: SiftTask, batch_id: str, what: str) -> None:
    """This run hands the task for ``what`` over to its next message (a retry, or one sent
    anew): its lease is given back before that message is published, or the message might
    come first and stand down."""
    lease: tuple[str, str, str] | None = getattr(_RUN, "lease", None)
    if lease is not None and lease[:2] == (batch_id, what):
        _KEEPER.drop(lease)
        task.context.store.economy_unlease(batch_id, what, lease[2])
        _RUN.lease = None
