"""What the queue machinery reads and counts beside the records: each task message's
deliveries, the queued and running gauge, the re-drive's view (:mod:`worker.queue.redrive`)
of the jobs not final yet and of the webhooks owed, and broker messages pushed as kombu's
Redis does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from worker.constants import (
    ACTIVE_JOBS_KEY,
    ATTEMPTS_FREED_KEY,
    ATTEMPTS_KEY,
    ATTEMPTS_TTL_SECONDS,
    BATCH_ID_PREFIX,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    BATCH_ORDER_KEY,
    ECONOMY_PREPARED_KEY,
    INGEST_ID_PREFIX,
    INGEST_KEY,
    REDRIVE_COUNT_KEY,
    REDRIVE_OUTAGES_KEY,
    REDRIVE_POSITIONS_KEY,
    SEARCH_KEY,
    STATS_KEY,
    WEBHOOKS_OWED_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.contract import JobStatus
from worker.queue.jobstore.jobindex import KIND_INGEST, job_index_key
from worker.queue.jobstore.records import WebhookStatus, _in_flight, _now
from worker.queue.jobstore.store import _StoreCore

# The re-drives of one position an outage may make free, and the deliveries of one task message
# (task id and retry) it may leave uncounted (DeliveryRecords.note_outage, count_delivery): each
# bounds what it frees, so a batch's chunks back after one restart are each freed, however many.
# Each is a run that waited out Redis unreachable for the client's whole window (30 s), then
# reached it again; a position's runs or a message's meeting that ten times is Redis failing
# under that job (a command of its own stalling it), which the delivery limit is there to
# stop, not outages it overlapped.
FREE_OUTAGE_REDRIVES = 10


def _record_key(job_id: str) -> str:
    """The record of a job with a webhook: a batch's or a search's."""
    return (BATCH_KEY if job_id.startswith(BATCH_ID_PREFIX) else SEARCH_KEY) + job_id


def _job_record_key(job_id: str) -> str:
    """The record of any job the re-drive sends again: a batch's, a search's or an ingest's."""
    return INGEST_KEY + job_id if job_id.startswith(INGEST_ID_PREFIX) else _record_key(job_id)


def _attempts_key(task_id: str, retry: int) -> str:
    return f"{ATTEMPTS_KEY}{task_id}:{retry}"


@dataclass(frozen=True, slots=True)
class WebhookClaim:
    """A webhook copy's claim of the attempt it makes (:meth:`DeliveryRecords.claim_webhook`):
    ``granted``, it sends it; else ``wait`` seconds are left on another copy's live claim of
    that attempt (look again then: that copy may have died), or ``wait`` is 0 and there is
    nothing left to send (the webhook was settled, or the attempt was made and a later one
    is due)."""

    granted: bool
    wait: float = 0.0


class DeliveryRecords(_StoreCore):
    """Delivery counters, the active set and the re-drive's counters, and raw task messages."""

    def count_delivery(self, task_id: str, retry: int, job_id: str | None = None) -> int:
        """How many times this message (task id, retry number) of the job ``job_id`` has been
        delivered, this one too. A delivery that is the return of a message whose last run an
        outage ended (:meth:`note_outage`; its ack lost, the orphan check put it back) uses
        that note up and is not counted (at most :data:`FREE_OUTAGE_REDRIVES` times a message)."""
        keys = [_attempts_key(task_id, retry), f"{ATTEMPTS_FREED_KEY}{task_id}:{retry}"]
        if job_id is not None:
            keys.append(REDRIVE_OUTAGES_KEY + job_id)
        args = [str(ATTEMPTS_TTL_SECONDS), f"{task_id}:{retry}", str(FREE_OUTAGE_REDRIVES)]
        return int(cast(int, self._count_delivery(keys=keys, args=args)))

    def set_deliveries(self, task_id: str, retry: int, count: int) -> None:
        """Start a message's delivery counter at ``count`` (a re-drive past its cap is sent
        already spent, so the task takes its poison path; a stopping worker's hand-back leaves
        its delivery uncounted), on a Redis at its ``maxmemory`` too
        (:data:`~worker.queue.jobstore.scripts._SET_DELIVERIES`)."""
        keys = [_attempts_key(task_id, retry)]
        self._set_deliveries(keys=keys, args=[str(count), str(ATTEMPTS_TTL_SECONDS)])

    def in_flight(self) -> dict[str, int]:
        """Searches and batch items queued and running now, across the deployment."""
        return _in_flight(cast(dict[str, str], self.redis.hgetall(STATS_KEY)))

    def stalled_jobs(self, idle_seconds: float) -> list[str]:
        """Search, ingest and batch ids not final whose status last changed more than
        ``idle_seconds`` ago, the longest idle first (however long: a job not final never
        expires)."""
        return self._active_until(_now() - idle_seconds)

    def active_jobs(self) -> list[str]:
        """Every search, ingest and batch id not final, however recently it moved
        (a clock ahead on the host that moved it too), the longest idle first."""
        return self._active_until("+inf")

    def active_ingests(self, tenant: str) -> list[str]:
        """The tenant's ingest jobs (upserts and deletes) not final: its ingest index (the
        ids of its ingests, :mod:`~worker.queue.jobstore.jobindex`) intersected with the
        active set, in Redis, so the read is the tenant's own, whatever the others queued."""
        keys = [job_index_key(KIND_INGEST, tenant), ACTIVE_JOBS_KEY]
        return cast(list[str], self.redis.zinter(keys))

    def _active_until(self, last_moved: float | str) -> list[str]:
        # none is dropped for its age: one idle past the retention is still queued or running
        # (its message waiting behind every worker stopped, or lost meanwhile), and the
        # re-drive that reads it forgets it only once it is final or gone
        return cast(list[str], self.redis.zrangebyscore(ACTIVE_JOBS_KEY, "-inf", last_moved))

    def forget_active(self, job_id: str) -> None:
        """Drop a job from the active set (its record is gone, or it is final)."""
        self.redis.zrem(ACTIVE_JOBS_KEY, job_id)

    def pending_positions(self, batch_id: str) -> list[int] | None:
        """The submission positions of a batch's items still queued or running and waiting
        on a chunk task (None: no such batch). An economy-lane item prepared already waits on
        a provider batch, not on a chunk: its submission and polls have their own watch
        (``sift:eco-watch``), so it is not pending here (a standard batch has no such hash)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(BATCH_ORDER_KEY + batch_id, 0, -1)
        pipe.hgetall(BATCH_ITEMS_KEY + batch_id)
        pipe.hkeys(ECONOMY_PREPARED_KEY + batch_id)
        order, statuses, prepared = cast(
            tuple[list[str], dict[str, str], list[str]], pipe.execute()
        )
        if not order:
            return None
        pending = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
        waiting = set(prepared)
        return [
            i for i, qid in enumerate(order) if statuses.get(qid) in pending and qid not in waiting
        ]

    def webhooks_overdue(self, due_before: float, limit: int) -> dict[str, float]:
        """Up to ``limit`` jobs whose webhook is owed and whose next message was due before
        ``due_before``, the longest overdue first (their final move wrote them): job id ->
        when its next message was due."""
        found = self.redis.zrangebyscore(
            WEBHOOKS_OWED_KEY, "-inf", due_before, 0, limit, withscores=True
        )
        return dict(cast(list[tuple[str, float]], found))

    def webhook_due(self, job_id: str, when: float, attempt: int | None = None) -> bool:
        """The owed webhook's next message is due at ``when`` (a retry's time, or a re-send's)
        and makes attempt ``attempt`` (a retry's; kept for :meth:`webhook_attempt`): each
        moved later only, and only while it is owed. A re-send's answer: whether the time
        moved. A retry's: whether it carries the schedule (False: another copy's retry has
        recorded this attempt already, or the webhook was settled, delivered by another copy
        or its schedule spent, so this copy stops; True when it is owed no more and its
        record does not say it was settled: a job an older release finished)."""
        keys = [WEBHOOKS_OWED_KEY, _record_key(job_id)]
        args = [repr(when), job_id, "" if attempt is None else str(attempt)]
        return bool(self._webhook_due(keys=keys, args=args))

    def webhook_attempt(self, job_id: str) -> int:
        """The attempt the job's owed webhook makes next, as its last retry recorded it (1:
        none recorded); a message the re-drive sends again makes that one."""
        return int(cast(str | None, self.redis.hget(_record_key(job_id), "webhook_attempt")) or 1)

    def webhook_unattempted(self, job_id: str) -> bool:
        """Whether the job's webhook is owed with no retry of it recorded, so its first message
        may have died with the worker that was to send it: a redelivered task's copy is worth
        sending. Once a retry is recorded its schedule runs (a lost message of it is the
        re-drive's, which goes on with it), and once delivered or given up it is owed no
        more: a copy then started a schedule of its own."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zscore(WEBHOOKS_OWED_KEY, job_id)
        pipe.hexists(_record_key(job_id), "webhook_attempt")
        owed, retried = pipe.execute()
        return owed is not None and not retried

    def claim_webhook(
        self, job_id: str, attempt: int, owner: str, *, lease_seconds: float
    ) -> WebhookClaim:
        """Claim attempt ``attempt`` of the job's webhook for the copy about to send it, one
        claim per job, whatever the task id of the copy: another copy of the same attempt
        (a redelivered task sent one while the first was on its way) waits while this one's
        worker ``owner`` keeps its heartbeat ('' : none; then the lease alone) and
        ``lease_seconds`` are not over, and a copy of it that runs once the attempt ended
        (settled, or a retry recorded) has nothing to send
        (:data:`~worker.queue.jobstore.scripts._CLAIM_WEBHOOK`)."""
        keys = [_record_key(job_id)]
        token = os.urandom(8).hex()
        args = [str(attempt), owner, repr(lease_seconds), WORKER_HEARTBEAT_KEY, token]
        granted, wait = cast(list[bytes | str | int], self._claim_webhook(keys=keys, args=args))
        return WebhookClaim(granted=int(granted) == 1, wait=float(wait))

    def webhook_was_settled(self, job_id: str) -> bool:
        """Whether the job's record says its webhook was settled (:meth:`webhook_settled`):
        a copy of it has nothing left to send."""
        return bool(self.redis.hexists(_record_key(job_id), "webhook_settled"))

    def webhook_settled(self, job_id: str, end: WebhookStatus, attempts: int) -> None:
        """The job's webhook is owed no more: ``end`` ``delivered``, or ``failed`` (refused,
        or its schedule spent), after ``attempts`` attempts. Its record says so (a copy
        failing later stops, :meth:`webhook_due`; its ``GET`` shows it; a delivery is never
        overwritten by another copy's failure, the attempts shown never go down, and an older
        release's settled mark, which did not say how, is kept). Also
        drops every entry due before the retention window: its job's record has expired, so
        there is nothing to send again, and with the re-drive off no sweep drops it."""
        keys = [WEBHOOKS_OWED_KEY, _record_key(job_id)]
        args = [job_id, repr(_now() - self.result_ttl), end, str(attempts)]
        self._webhook_settled(keys=keys, args=args)

    def count_redrive(self, job_id: str) -> int:
        """Count one more re-drive of this job (none for one whose run an outage ended:
        :meth:`note_outage`); answers how many there have been."""
        (count,) = self._count_redrives_of(REDRIVE_COUNT_KEY + job_id, "string", job_id, [0])
        return count

    def count_redrive_positions(self, batch_id: str, positions: Iterable[int]) -> dict[int, int]:
        """Count one more re-drive of each of a batch's ``positions`` (none for one whose run an
        outage ended: :meth:`note_outage`); answers how many each has had (a chunk lost once is
        not spent by its batch's other chunks' re-drives)."""
        ordered = sorted(positions)
        counts = self._count_redrives_of(
            REDRIVE_POSITIONS_KEY + batch_id, "hash", batch_id, ordered
        )
        return dict(zip(ordered, counts, strict=True))

    def note_outage(
        self, job_id: str, positions: Iterable[int], delivery: tuple[str, int] | None = None
    ) -> None:
        """The runs of the job's ``positions`` (a search's or an ingest's: 0) ended because
        Redis was unreachable past the client's retries, under the task message ``delivery``
        (task id, retry number): whichever way the job comes back, that is no fault of its
        own, and is not counted against ``SIFT_TASK_MAX_DELIVERIES``. The note pays for one
        return, whichever comes first: a re-drive of a noted position is not counted
        (:meth:`count_redrive`; at most :data:`FREE_OUTAGE_REDRIVES` times a position: a job
        whose runs keep meeting Redis unreachable is judged as any other), or the message
        comes back itself (left unacked, its ack lost with the outage, the orphan check puts
        it back) and that delivery is not counted, as a hand-back's is
        (:meth:`count_delivery`; at most :data:`FREE_OUTAGE_REDRIVES` times a message).
        Nothing is written for a job whose record is gone (erased, purged, expired: nothing a
        late run writes brings its keys back) or final (nothing of it is sent again)."""
        keys = [_job_record_key(job_id), REDRIVE_OUTAGES_KEY + job_id]
        message = "" if delivery is None else f"{delivery[0]}:{delivery[1]}"
        args = [str(self.result_ttl), message, *map(str, positions)]
        self._note_outage(keys=keys, args=args)

    def _count_redrives_of(
        self, key: str, kind: str, job_id: str, positions: Sequence[int]
    ) -> list[int]:
        """One :data:`~worker.queue.jobstore.scripts._COUNT_REDRIVES` call: the re-drives
        counted at ``key`` (a ``kind`` ``hash`` or ``string``) of each of ``positions``."""
        keys = [key, REDRIVE_OUTAGES_KEY + job_id, _job_record_key(job_id)]
        args = [str(self.result_ttl), kind, str(FREE_OUTAGE_REDRIVES), *map(str, positions)]
        counts = cast(list[int], self._count_redrives(keys=keys, args=args))
        return [int(count) for count in counts]

    def push_messages(
        self, messages: Sequence[tuple[str, str]], *, next_taken: bool = False
    ) -> None:
        """LPUSH ready-made broker messages, (list key, raw message), as kombu's Redis does:
        behind every message waiting. ``next_taken``: RPUSH, at the end a worker's ``BRPOP``
        takes from, as the broker puts back a message handed back unprocessed
        (:mod:`worker.queue.broker`): ahead of every message waiting in its list."""
        pipe = self.redis.pipeline(transaction=False)
        for key, raw in messages:
            (pipe.rpush if next_taken else pipe.lpush)(key, raw)
        pipe.execute()
