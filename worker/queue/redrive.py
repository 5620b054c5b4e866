"""The re-drive: finds searches, ingests, batch chunks and webhooks whose task message the
broker lost, and enqueues them again.

Why it exists. kombu's Redis transport takes a message with ``BRPOP`` and only then records
it in its ``unacked`` hash, in a second command. A worker killed between the two, or a Redis
killed after the pop reached its AOF but before the reply, loses that message: it is in no
queue and not unacked, so neither the late ack nor the visibility-timeout restore brings it
back, and its job would stay ``queued`` forever.

How. Every worker process runs a :class:`Sweeper` thread; every
``SIFT_REDRIVE_INTERVAL_SECONDS`` one of them, the holder of a ``SET NX PX`` lock, sweeps:

1. the job store's active set names the searches, ingests and batches whose
   status has not changed for ``SIFT_REDRIVE_STALL_SECONDS``; a job making progress is not
   read, unless an *urgent window* is open (below), when every active job is;
2. of those, the positions still ``queued`` or ``running`` are *pending* (a search or an
   ingest is the one position 0, a batch item its submission position);
3. every message of the search, batch and ingest queues (``LRANGE``) and every unacked one
   (the ``unacked`` hash: running, prefetched, or waiting out a retry's countdown) *covers*
   its search or ingest, or its chunk's positions ``[start, stop)``; so does a batch chunk a
   live run holds by its run claim (:meth:`JobStore.held_chunks`): a copy of its message that
   the claim refused was acked, and kombu's restore at a reconnect had moved the run's own
   message to that copy;
4. a pending position nothing covers is *lost*. Only positions found lost on two sweeps in
   a row are re-driven: a message is missing from both places only for the few milliseconds
   a worker takes to move it (``BRPOP``, then ``unacked``), never on two sweeps an interval
   apart, because a chunk task holds its message in ``unacked`` until each of its items is
   final, and whatever else moves it keeps it covered: a retry publishes its next message
   before the ack, a hand-back (``Reject(requeue=True)``) and every restore move it from
   ``unacked`` to a queue in one transaction, a paused batch-queue intake leaves its
   prefetched messages unacked, and a submission commits its job and its messages in one
   ``MULTI``. ``unacked`` is read both before and after the queues, so a message moved
   from one to the other while they are read is still seen;
5. re-driving sends a fresh ``sift.search``, ``sift.ingest`` or ``sift.batch_chunk`` message,
   chunks of at most
   ``SIFT_BATCH_CHUNK_SIZE`` positions. The tasks are idempotent (the store's compare-and-set
   keeps one result per item), so even a needless re-drive costs only a no-op task.

A job is re-driven at most ``SIFT_TASK_MAX_DELIVERIES`` times. Past that its next message is
sent with its delivery counter already spent, so the task takes its poison path: the pending
items fail as ``delivery_limit_exceeded`` (metrics and webhook as usual) instead of looping.
A re-drive of a run that Redis unreachable ended is not counted (the run noted the outage,
:mod:`worker.queue.jobstore.outages`), up to ``FREE_OUTAGE_REDRIVES`` times a position.

Why stalled jobs only, and the urgent window. Reading a job's pending positions costs, for a
100,000-query batch, an ``LRANGE`` of its order and an ``HGETALL`` of its items: too much to
do every interval for every batch in progress, and the two-sweep confirmation, not the stall
filter, is what keeps a waiting message from being sent twice. So a busy batch is left alone,
except right after an event that can lose a message, when the cost is paid to recover it in
one or two intervals instead of after the whole batch has gone idle: a worker killed (the
dead-worker check of :mod:`worker.queue.liveness` finding it dead), or a broker connection
broken while a reply was on its way (a sweep finding Redis's ``run_id`` changed since the
last one: Redis restarted; or a worker's consumer starting again after its connection
dropped, :class:`ReconnectStep`, the only sign of a connection that broke while Redis stayed
up). Each sets ``sift:redrive:urgent`` for
:data:`~worker.queue.urgent_window.URGENT_WINDOW_INTERVALS` intervals, the next two sweeps,
and logs why (:func:`~worker.queue.urgent_window.open_urgent_window`, a module below both
the re-drive and the liveness check); while it is set, a sweep reads every active job, and
the sweep after its opening, and the one confirming what a sweep in it saw lost, come within
:data:`~worker.queue.urgent_window.URGENT_SWEEP_SECONDS` (5 s), not an interval on. The
stored ``run_id`` survives a restart with the AOF on, as ``sift up`` and ``deploy/`` run Redis;
without persistence a restart loses every job and message anyway, so there is nothing to
recover.

An economy batch's chunks are swept this way too, but not its prepared items: they wait on
provider batches for hours by design (not *pending*: :meth:`JobStore.pending_positions`), and
once all are prepared the batch leaves the active set. Its submissions and polls say by when
each should run again instead, and a sweep sends again one that did not
(:func:`worker.queue.economy.rewake`). A re-driven chunk of an economy batch prepares its
items, and the one chunk that finds every item prepared or final enqueues the one
submission (a once-only claim), so a re-drive never makes a second provider batch.

Webhooks. A job's final move (the same script: no round trip more) records its webhook owed
in ``sift:webhooks-owed``, scored when its next message is due: the move's time, then each
retry's. The delivery task drops it once the webhook is final (delivered, refused, or its
schedule spent), and with it every entry due before the retention window (its record has
expired), so the set stays bounded with the re-drive off too. So a webhook whose message was
lost in the same pop-then-unacked window, or never published (its worker died between the
final move and the publish), stays owed past its due time, and a sweep sends it again once
it is overdue by ``webhook_grace_seconds`` (the broker's visibility timeout, 1,600 s at the
defaults: a live message has mostly run by then, or been put back) and no message of it is
in the webhook queue or ``unacked`` (one late behind a backlog is looked at again a grace
later) (:meth:`Sweeper.resend_webhooks`). While an urgent window is open (a worker found
dead, Redis restarted, a broker reconnect: the events that lose a message) a webhook does not
wait out the grace: one already due with no message in the broker on two sweeps in a row, at
the same due time both times, is sent again then, the confirming sweep coming within
:data:`~worker.queue.urgent_window.URGENT_SWEEP_SECONDS` (``sift:redrive:webhook-suspects``
keeps what a sweep saw, job id -> due time, as ``sift:redrive:suspects`` does for chunks).
A live message is always in the broker (queued; or unacked: running, or waiting out a
retry's countdown or a hop, the next one published before the ack), a retry recorded between
the two sweeps moves the due time, and one settled meanwhile is owed no more
(:meth:`JobStore.webhook_due` answers False), so none of them is sent again. Either way it is
the same event, the same ``webhook-id``, so a receiver that had it after all drops the copy.
It makes the attempt whose message was lost (each retry records it in the job's record,
:meth:`JobStore.webhook_attempt`): the schedule goes on, so a webhook is attempted at most
the schedule's number of times in all.

Redis's files. A sweep also asks Redis to rewrite its files (AOF, RDB) when an erasure owes
it a rewrite that the interval's latch held back (:mod:`worker.queue.jobstore.rewrite`): the
erases of a burst after the first leave the disk once the latch ends, with no erase after
them.

    sweeper = Sweeper(store, celery_sender(app), interval_seconds=30, stall_seconds=120)
    sweeper.start()          # a daemon thread; sweeper.sweep() runs one sweep (tests)
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
from celery import bootsteps

from worker import clock
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_ID_PREFIX,
    BATCH_QUEUE,
    INGEST_ID_PREFIX,
    INGEST_QUEUE,
    INGEST_TASK,
    KOMBU_UNACKED_KEY,
    REDRIVE_LEADER_KEY,
    REDRIVE_RUN_ID_KEY,
    REDRIVE_SUSPECTS_KEY,
    REDRIVE_URGENT_KEY,
    REDRIVE_WEBHOOK_SUSPECTS_KEY,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_BATCH_COMPLETED,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
    kombu_queue_keys,
)
from worker.observability import metrics
from worker.queue import liveness
from worker.queue.jobstore import JobStore, Rewrite, webhook_event
from worker.queue.urgent_window import hurry_next_sweep, open_urgent_window, urgent_sweep_seconds
from worker.redis_client import connect

log = logging.getLogger(__name__)

#: What a worker says, once, when its Redis user may not run ``INFO``: what the sweep loses
INFO_REFUSED = (
    "re-drive: this Redis user may not run INFO, so a Redis restart is not seen by its run_id;"
    " messages a restart cut off are re-driven once their jobs stall"
    " (SIFT_REDRIVE_STALL_SECONDS), not in the urgent window. Allow INFO (+info) to have it"
)

# Sends one task message: (task name, JSON args, queue, task id).
Send = Callable[[str, list[Any], str, str], None]

PAGE = 1_000  # messages read per LRANGE or HSCAN step
SUSPECTS_KEPT_SWEEPS = 10  # the suspects of a sweep expire this many intervals later


@dataclass(frozen=True, slots=True)
class Coverage:
    """What one broker message works on: a job and the positions of it that it covers."""

    job_id: str
    positions: range


@dataclass(frozen=True, slots=True)
class Redrive:
    """One job re-driven by a sweep: the position ranges sent again, and whether as poison."""

    job_id: str
    kind: str
    chunks: list[tuple[int, int]]
    poison: bool


def coverage(envelope: Mapping[str, Any]) -> Coverage | None:
    """The job a kombu message envelope (protocol 2) works on; None for any other task or
    for a message that is not Celery's."""
    try:
        task = envelope["headers"]["task"]
        if task not in (SEARCH_TASK, INGEST_TASK, BATCH_CHUNK_TASK):
            return None
        args = _args(envelope)
        if task != BATCH_CHUNK_TASK:  # a search or an ingest: one position
            return Coverage(str(args[0]), range(0, 1))
        return Coverage(str(args[0]), range(int(args[1]), int(args[2])))
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _args(envelope: Mapping[str, Any]) -> Any:
    """The task's positional arguments in a kombu message envelope (protocol 2)."""
    body: str | bytes = envelope["body"]
    if envelope.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    return json.loads(body)[0]  # the body is [args, kwargs, embed]


def runs(positions: Iterable[int], longest: int | None = None) -> list[tuple[int, int]]:
    """Sorted positions as ``[start, stop)`` runs of consecutive ones, each at most
    ``longest`` long: ``runs([1, 2, 3, 7], 2) == [(1, 3), (3, 4), (7, 8)]``."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if out and out[-1][1] == p and (longest is None or p - out[-1][0] < longest):
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def broker_reconnected(settings: Any) -> None:
    """This worker's broker connection dropped and is back: a ``BRPOP`` reply it cut off may
    have lost a message, so open the urgent window (a failure is only logged: the run_id
    check still sees a restart)."""
    if not settings.redrive_interval_seconds or not settings.redis_url:
        return
    client = connect(settings.redis_url, socket_timeout=5.0)
    try:
        open_urgent_window(
            client,
            settings.redrive_interval_seconds,
            "this worker's broker connection dropped and is back",
        )
    except Exception as exc:  # never in the way of the consumer starting again
        log.warning("re-drive: could not open the urgent window after a reconnect: %s", exc)
    finally:
        client.close()


class ReconnectStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer bootstep: Celery starts the consumer again after a lost broker connection,
    and every start but the first has this worker put back the deliveries Celery dropped with
    the lost channel (:func:`worker.queue.liveness.reconnected`: a retry's countdown, an
    economy poll, waiting in memory on messages still in ``unacked``), then calls
    :func:`broker_reconnected`. It runs before the consumer takes anything on the new
    connection.

    Only a connection lost with a ``BRPOP`` sent on it restarts the consumer. One dropped
    while still idle in redis-py's pool (between the consumer's start and its first
    ``BRPOP``) is replaced unseen when the consumer takes it: no reply was cut off, so
    there is nothing to look for."""

    requires = ("celery.worker.consumer.connection:Connection",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.starts = 0

    def start(self, c: Any) -> None:
        self.starts += 1
        if self.starts == 1:
            return
        liveness.reconnected()
        settings = getattr(c.app.conf, "sift_settings", None)
        if settings is not None:
            broker_reconnected(settings)


def celery_sender(app: Any) -> Send:
    """A :data:`Send` through a Celery app (the worker's own, which knows Sift's queues)."""

    def send(name: str, args: list[Any], queue: str, task_id: str) -> None:
        app.send_task(name, args=args, queue=queue, task_id=task_id, ignore_result=True)

    return send


class Sweeper:
    """Finds jobs whose task message was lost and enqueues it again (see the module doc)."""

    def __init__(
        self,
        store: JobStore,
        send: Send,
        *,
        interval_seconds: float,
        stall_seconds: float,
        chunk_size: int = 25,
        max_deliveries: int = 3,
        webhook_grace_seconds: float = 1600.0,
    ) -> None:
        """``max_deliveries`` is the tasks' ``SIFT_TASK_MAX_DELIVERIES``: a job is re-driven
        that many times at most, and a poison message is sent with that many counted.
        ``webhook_grace_seconds``: how long past its due time an owed webhook is sent again
        (a worker's sweeper: the broker's visibility timeout; this default is the
        defaults')."""
        self.store = store
        self.send = send
        self.interval_seconds = interval_seconds
        self.stall_seconds = stall_seconds
        self.chunk_size = chunk_size
        self.max_deliveries = max_deliveries
        self.webhook_grace_seconds = webhook_grace_seconds
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._info_refused = False  # said once: INFO_REFUSED

    # --- the thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Sweep every interval on a daemon thread, when this process holds the lock."""
        self._thread = threading.Thread(target=self._run, name="sift-redrive", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        # looks every urgent_sweep_seconds: the lock says when a sweep is due (an interval
        # after the last, or sooner while an urgent window is open)
        while not self._stop.wait(urgent_sweep_seconds(self.interval_seconds)):
            try:
                self.sweep_if_leader()
            except Exception as exc:  # Redis restarting, say: the next interval tries again
                log.warning("re-drive sweep failed: %s", exc)

    def sweep_if_leader(self) -> list[Redrive] | None:
        """Sweep if no other worker has this interval (None when another one has it)."""
        lock_ms = max(1, int(self.interval_seconds * 1000))
        if not self.store.redis.set(REDRIVE_LEADER_KEY, self.name, nx=True, px=lock_ms):
            return None
        redriven = self.sweep()
        # in an urgent window, positions (or webhooks) seen lost are confirmed by a sweep soon,
        # not an interval on (the window's other sweeps keep to the interval)
        client = self.store.redis
        suspects = (REDRIVE_SUSPECTS_KEY, REDRIVE_WEBHOOK_SUSPECTS_KEY)
        if client.exists(REDRIVE_URGENT_KEY) and client.exists(*suspects):
            hurry_next_sweep(client, self.interval_seconds)
        return redriven

    # --- one sweep --------------------------------------------------------------------------

    def sweep(self) -> list[Redrive]:
        """Re-drive what this sweep and the one before both found lost; answers what it sent."""
        self.note_restart()
        self.rewake_economy()
        self.resend_webhooks()
        self.rewrite_owed()
        urgent = bool(self.store.redis.exists(REDRIVE_URGENT_KEY))
        lost = self.lost_positions(urgent=urgent)
        previous = self._suspects()
        confirmed = {job: lost[job] & previous[job] for job in lost if job in previous}
        confirmed = {job: positions for job, positions in confirmed.items() if positions}
        self._remember({job: lost[job] - confirmed.get(job, set()) for job in lost})
        return [self._redrive(job, positions) for job, positions in confirmed.items()]

    def rewake_economy(self) -> int:
        """The economy lane's tasks whose message was lost, sent again (its batches are not
        swept as the others are: they wait on provider batches for hours by design)."""
        from worker.queue.economy import rewake

        return rewake(self.store, self.send, clock.now())  # the due times' clock, Redis's

    def rewrite_owed(self) -> Rewrite:
        """Ask Redis to rewrite its files if an erasure owes it a rewrite that the interval's
        latch held back (:mod:`~worker.queue.jobstore.rewrite`): the last erase of a burst is
        off the disk an interval and a sweep after it at most."""
        return self.store.rewrite_files()

    def resend_webhooks(self, now: float | None = None) -> list[str]:
        """Send again each owed webhook with no message in the broker (lost, or never
        published) once it is overdue by the grace, or, while an urgent window is open, once
        it is due and two sweeps in a row found it so at the same due time; answers their job
        ids. ``now``: the sweep's clock (tests move it on)."""
        now = clock.now() if now is None else now  # the owed dues' clock, Redis's
        urgent = bool(self.store.redis.exists(REDRIVE_URGENT_KEY))
        grace_ends = now - self.webhook_grace_seconds
        owed = self.store.webhooks_overdue(now if urgent else grace_ends, PAGE)
        waiting = self._waiting_webhooks(set(owed)) if owed else set()
        lost: dict[str, str] = {}
        missing: dict[str, float] = {}
        for job_id, due in owed.items():
            if due > grace_ends:  # due, not overdue: looked at in a window only
                if job_id not in waiting:
                    missing[job_id] = due
            elif job_id in waiting:  # late (a backlog, its workers away), not lost
                self.store.webhook_due(job_id, now)  # looked at again a grace later
            else:
                lost[job_id] = f"still owed {self.webhook_grace_seconds:g}s past its due time"
        for job_id in self._confirmed_webhooks(missing):
            lost[job_id] = "due with no message on two sweeps of an urgent window"
        sent = [job_id for job_id, why in lost.items() if self._resend_webhook(job_id, now, why)]
        if sent:
            metrics.redriven("webhook", len(sent))
        return sent

    def _confirmed_webhooks(self, missing: Mapping[str, float]) -> list[str]:
        """Those of ``missing`` (due, no message: job id -> due time) that the sweep before
        found so at the same due time; the others are kept for the next sweep to confirm. A
        retry recorded between the two moved its due time: a message was there meanwhile.
        Outside a window ``missing`` is empty, and nothing is kept."""
        client = self.store.redis
        previous = cast(dict[str, str], client.hgetall(REDRIVE_WEBHOOK_SUSPECTS_KEY))
        confirmed = [job for job, due in missing.items() if previous.get(job) == repr(due)]
        suspects = {job: repr(due) for job, due in missing.items() if job not in confirmed}
        self._keep_suspects(REDRIVE_WEBHOOK_SUSPECTS_KEY, suspects)
        return confirmed

    def _resend_webhook(self, job_id: str, now: float, why: str) -> bool:
        """Send a lost webhook's message again, due at ``now``; whether it was sent."""
        event = self._owed_event(job_id)
        if event is None:  # its record expired: nothing to announce (nor to write)
            self.store.webhook_settled(job_id, "failed", 0)
            return False
        # due again now, so looked at again if lost again; not moved: settled meanwhile
        if not self.store.webhook_due(job_id, now):
            return False
        self.send(WEBHOOK_TASK, [event], WEBHOOK_QUEUE, str(uuid.uuid4()))
        log.warning("webhook msg_%s: %s; its message was lost, sent again", job_id, why)
        return True

    def _waiting_webhooks(self, job_ids: set[str]) -> set[str]:
        """Those of ``job_ids`` whose webhook has a message in the broker: waiting in its
        queue, or held unacked (running, or waiting out a retry's countdown)."""
        found: set[str] = set()
        for envelope in self._broker_messages((WEBHOOK_QUEUE,)):
            try:
                if envelope["headers"]["task"] == WEBHOOK_TASK:
                    found.add(str(_args(envelope)[0]["data"]["id"]))
            except (KeyError, IndexError, TypeError, ValueError):
                continue
        return found & job_ids

    def _owed_event(self, job_id: str) -> dict[str, Any] | None:
        """The event of a finished job's webhook, as its final move announced it, making the
        attempt its last retry recorded (:meth:`JobStore.webhook_attempt`)."""
        finished_at: float | None
        if job_id.startswith(BATCH_ID_PREFIX):
            batch = self.store.get_batch(job_id)
            if batch is None or batch.finished_at is None or not batch.webhook_url:
                return None
            kind, tenant, url = WEBHOOK_EVENT_BATCH_COMPLETED, batch.tenant, batch.webhook_url
            status, finished_at = batch.status.value, batch.finished_at
        else:
            search = self.store.get_search(job_id)
            if search is None or not search.status.final or not search.webhook_url:
                return None
            kind, tenant, url = WEBHOOK_EVENT_SEARCH_COMPLETED, search.tenant, search.webhook_url
            status, finished_at = search.status.value, search.finished_at
        event = webhook_event(kind, job_id, tenant, url, status, occurred_at=finished_at)
        # the attempt whose message was lost: the schedule goes on, it does not begin again
        return {**event, "attempt": self.store.webhook_attempt(job_id)}

    def note_restart(self) -> None:
        """Open an urgent window if Redis has restarted since the last sweep: a pop whose reply
        the restart cut off has lost its message. Redis's ``run_id`` changes at every start;
        the one this sweep sees replaces the one the last sweep stored. A user that may not
        run ``INFO`` (a managed service's, ``-info``) has no ``run_id`` to read: the check is
        skipped, said once (:data:`INFO_REFUSED`), and the rest of the sweep runs; a marker
        key would be no substitute, since it survives the restarts (AOF on) it should see."""
        client = self.store.redis
        try:
            run_id = str(client.info("server")["run_id"])
        except redis.exceptions.NoPermissionError:
            if not self._info_refused:
                self._info_refused = True
                log.warning(INFO_REFUSED)
            return
        previous = cast(str | None, client.set(REDRIVE_RUN_ID_KEY, run_id, get=True))
        if previous is not None and previous != run_id:
            open_urgent_window(
                client,
                self.interval_seconds,
                f"Redis restarted (run_id {previous} -> {run_id})",
                hurry=False,  # this very sweep reads every active job
            )

    def lost_positions(self, *, urgent: bool = False) -> dict[str, set[int]]:
        """Positions of idle jobs (every active job when ``urgent``) still pending with no
        message in the broker, by job id."""
        watched = (
            self.store.active_jobs() if urgent else self.store.stalled_jobs(self.stall_seconds)
        )
        pending: dict[str, set[int]] = {}
        for job_id in watched:
            positions = self._pending(job_id)
            if positions:
                pending[job_id] = positions
            else:  # final, or its record expired: nothing left to watch
                self.store.forget_active(job_id)
        if not pending:
            return {}
        covered: dict[str, set[int]] = {job: set() for job in pending}
        for message in self._broker_messages():
            found = coverage(message)
            if found is not None and found.job_id in covered:
                covered[found.job_id].update(found.positions)
        lost = {job: positions - covered[job] for job, positions in pending.items()}
        for job, positions in lost.items():
            if positions and job.startswith(BATCH_ID_PREFIX):
                # a chunk a live run holds by its claim (jobstore/runs.py) is that run's: a
                # copy it refused was acked, and may have taken the run's own message with it
                # (kombu's restore at a reconnect). Re-driven, it was refused again, each copy
                # spending the batch's re-drives; one over other positions ran beside it
                for held in self.store.held_chunks(job):
                    positions.difference_update(held)
        return {job: positions for job, positions in lost.items() if positions}

    def _pending(self, job_id: str) -> set[int]:
        if job_id.startswith(BATCH_ID_PREFIX):
            return set(self.store.pending_positions(job_id) or ())
        if job_id.startswith(INGEST_ID_PREFIX):
            status = self.store.get_ingest_status(job_id)
        else:
            status = self.store.get_search_status(job_id)
        return {0} if status is not None and not status.final else set()

    def _broker_messages(
        self, queues: Iterable[str] = (SEARCH_QUEUE, BATCH_QUEUE, INGEST_QUEUE)
    ) -> Iterator[Mapping[str, Any]]:
        """Every unacked envelope, every one waiting in ``queues`` (the search, batch and
        ingest queues), then every unacked one again.

        Read in pages while workers keep pushing and popping: a push only shifts what is left
        to read (seen twice at worst); a message popped meanwhile is in ``unacked`` by the
        second read of it, or in the millisecond window the second sweep is there for; one
        restored or handed back from ``unacked`` to a queue meanwhile was in ``unacked`` at
        the first read, or is in its queue by the time that is read."""
        yield from self._unacked_messages()
        client = self.store.redis
        for queue in queues:
            for key in kombu_queue_keys(queue):
                start = 0
                while page := cast(list[str], client.lrange(key, start, start + PAGE - 1)):
                    for raw in page:
                        if envelope := _loads(raw):
                            yield envelope
                    start += PAGE
        yield from self._unacked_messages()

    def _unacked_messages(self) -> Iterator[Mapping[str, Any]]:
        for _, raw in self.store.redis.hscan_iter(KOMBU_UNACKED_KEY, count=PAGE):
            entry = _loads(raw)  # [message, exchange, routing key]
            if isinstance(entry, list) and entry and isinstance(entry[0], dict):
                yield entry[0]

    def _suspects(self) -> dict[str, set[int]]:
        raw = cast(dict[str, str], self.store.redis.hgetall(REDRIVE_SUSPECTS_KEY))
        return {
            job: {p for start, stop in json.loads(value) for p in range(start, stop)}
            for job, value in raw.items()
        }

    def _remember(self, lost: Mapping[str, set[int]]) -> None:
        """Keep this sweep's lost positions (as runs) for the next sweep to confirm."""
        suspects = {
            job: json.dumps(runs(positions)) for job, positions in lost.items() if positions
        }
        self._keep_suspects(REDRIVE_SUSPECTS_KEY, suspects)

    def _keep_suspects(self, key: str, suspects: Mapping[str, str]) -> None:
        """Replace the hash ``key`` with ``suspects`` (what this sweep saw lost, for the next
        to confirm), kept a few sweeps."""
        pipe = self.store.redis.pipeline(transaction=True)
        pipe.delete(key)
        for job, seen in suspects.items():
            pipe.hset(key, job, seen)
        if suspects:
            keep_ms = max(1000, int(SUSPECTS_KEPT_SWEEPS * self.interval_seconds * 1000))
            pipe.pexpire(key, keep_ms)
        pipe.execute()

    def _redrive(self, job_id: str, positions: set[int]) -> Redrive:
        """Send the lost work again; past the cap, send it as poison. A batch's positions are
        counted each on its own: only those re-driven past the cap go out spent, in chunks of
        their own, so a chunk lost once is never spent by its batch's other chunks."""
        cap = self.max_deliveries
        sends: list[tuple[str, list[object], str, bool]]  # (task, args, queue, spent)
        if job_id.startswith(BATCH_ID_PREFIX):
            counts = self.store.count_redrive_positions(job_id, positions)
            count = max(counts.values())
            spent = {p for p, n in counts.items() if n > cap}
            kind = "batch"
            parts = [(a, b, False) for a, b in runs(positions - spent, self.chunk_size)]
            parts += [(a, b, True) for a, b in runs(spent, self.chunk_size)]
            sends = [(BATCH_CHUNK_TASK, [job_id, a, b], BATCH_QUEUE, s) for a, b, s in parts]
            chunks = [(a, b) for a, b, _ in parts]
        else:
            count = self.store.count_redrive(job_id)
            ingest = job_id.startswith(INGEST_ID_PREFIX)
            kind, task, queue = (
                ("ingest", INGEST_TASK, INGEST_QUEUE)
                if ingest
                else ("search", SEARCH_TASK, SEARCH_QUEUE)
            )
            sends, chunks = [(task, [job_id], queue, count > cap)], [(0, 1)]
        for name, args, queue, poison in sends:
            task_id = str(uuid.uuid4())
            if poison:  # its first delivery then counts one past the limit
                self.store.set_deliveries(task_id, 0, cap)
            self.send(name, args, queue, task_id)
        metrics.redriven(kind, len(sends))
        poisoned = any(poison for *_, poison in sends)
        log.warning(
            "%s %s: no task message for %d pending position(s) %s on two sweeps; re-driven "
            "(%d of %d)%s",
            kind,
            job_id,
            len(positions),
            chunks,
            count,
            cap,
            ": past the cap, sent spent (its task fails as poison what is not judged by "
            "its own runs lost)"
            if poisoned
            else "",
        )
        return Redrive(job_id, kind, chunks, poisoned)


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def start_sweeper(app: Any, *, webhook_grace_seconds: float) -> Sweeper | None:
    """Start the re-drive in this worker process from its Celery app's Sift settings; None
    when ``SIFT_REDRIVE_INTERVAL_SECONDS`` is 0."""
    settings = app.conf.sift_settings
    if not settings.redrive_interval_seconds or not settings.redis_url:
        return None
    sweeper = Sweeper(
        JobStore.from_url(
            settings.redis_url, max_connections=4, result_ttl=settings.result_retention_seconds
        ),
        celery_sender(app),
        interval_seconds=settings.redrive_interval_seconds,
        stall_seconds=settings.redrive_stall_seconds,
        chunk_size=settings.batch_chunk_size,
        max_deliveries=settings.task_max_deliveries,
        webhook_grace_seconds=webhook_grace_seconds,
    )
    sweeper.start()
    log.info(
        "re-drive: sweeping every %gs for jobs idle over %gs (every active job after a dead "
        "worker, a Redis restart or a broker reconnect) and webhooks owed %gs past due",
        settings.redrive_interval_seconds,
        settings.redrive_stall_seconds,
        webhook_grace_seconds,
    )
    return sweeper
