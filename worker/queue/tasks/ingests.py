"""The ingest task: one ingest job (an upsert), or a delete or drop job
(:mod:`worker.queue.lifecycle`), under its claim."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from celery import shared_task

from worker import clock
from worker.constants import (
    INGEST_QUEUE,
    INGEST_TASK,
)
from worker.contract import ErrorInfo
from worker.errors import SiftError
from worker.observability import metrics
from worker.queue import lifecycle, liveness
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.config import time_limits
from worker.queue.intake import INTAKE
from worker.queue.jobstore import (
    IngestJob,
    RunClaim,
    settle_outage,
)
from worker.queue.tasks._runs import poison_error
from worker.redis_client import unreachable

log = logging.getLogger(__name__)


@shared_task(  # type: ignore[untyped-decorator]
    name=INGEST_TASK, base=SiftTask, bind=True
)
def ingest(self: SiftTask, job_id: str) -> None:
    """Upsert one ingest job's documents into the tenant's index, or run a delete job (the
    same record kind, with ``operation`` "delete" or "drop": :mod:`worker.queue.lifecycle`)."""
    store = self.context.store
    job = store.get_ingest(job_id)
    if job is None or job.status.final:
        return
    # claimed first, as a search is: a copy delivered while another live run holds the job
    # (kombu's restore at a broker reconnect puts back a running task's message) writes
    # nothing, not even its start, and is no poison (its worker is not lost)
    lease = time_limits(self.context.settings)[INGEST_TASK][1]  # the longest a run may run
    claim = store.claim_ingest(job_id, liveness.run_owner(), lease_seconds=lease)
    if not claim.granted:
        log.info("ingest %s: another run holds it; this delivery leaves it", job_id)
        return
    try:
        _ingest(self, job, claim)
    except redis.RedisError as exc:
        # the job store (Redis) failed, not the ingest: it stays running for its redelivery
        # (the re-drive), its claim in Redis as it is, as a search's (upserts and deletes
        # are versioned: one run again writes nothing twice, and a delete's count is kept);
        # Redis unreachable, that re-drive is not counted, as a search's
        try:
            if unreachable(exc):
                settle_outage(store, job_id, [0], delivery=self.delivered())
        finally:
            store.ended_ingest(job_id, claim)
        raise
    except BaseException:
        store.release_ingest(job_id, claim)
        raise
    # (a retry let go before it was sent: this release then finds nothing to do)
    store.release_ingest(job_id, claim)


class _Stopping(Exception):
    """The worker is stopping while an upsert's documents are embedded: handed back."""


def _stop_check(total: int) -> Callable[[int], None]:
    """An upsert's progress callback: raises :class:`_Stopping` at the end of an embedded
    chunk once the worker is stopping, unless it was the last (the write alone is left)."""
    embedded = 0

    def check(chunk: int) -> None:
        nonlocal embedded
        embedded += chunk
        if INTAKE.stopping and embedded < total:
            raise _Stopping

    return check


def _ingest(task: SiftTask, job: IngestJob, claim: RunClaim) -> None:
    """Run the ingest ``job`` under its run ``claim``. An upsert whose worker stops while its
    documents are embedded goes back on its queue at the end of the chunk under way, nothing
    written, its delivery not counted (a stop is no crash), for the next worker: not run on
    to the stop deadline, cut there, and back as a killed worker's, counted towards its
    delivery limit."""
    store, job_id = task.context.store, job.id
    deliveries = task.delivery(job_id)
    if task.poisoned(deliveries, job_id=job_id):
        count_completed(
            "ingest", store.finish_ingest(job_id, error=poison_error(task)), poison_error(task)
        )
        return
    deleting = job.operation != "upsert"
    ids = store.deletion_ids(job_id) if job.operation == "delete" else None
    documents = store.ingest_documents(job_id) if not deleting else []
    if documents is None or (job.operation == "delete" and ids is None):
        expired = ErrorInfo(type="expired", message="documents expired")
        count_completed("ingest", store.finish_ingest(job_id, error=expired), expired)
        return
    if not store.start_ingest(job_id):
        return
    if job.started_at is None and not claim.spent:  # its first run (as a search's)
        metrics.observe_queue_wait(INGEST_QUEUE, clock.now() - job.created_at)
    try:
        task.context.admit(job.tenant)  # a removed tenant's ingest or delete ends here, unrun
        if deleting:
            deleted = lifecycle.delete(task.context.runtime, job, ids, jobs=store)
        else:
            upserted = task.context.runtime.ingest(
                job.index, job.tenant, documents, _stop_check(len(documents)), version=job.version
            )
    except _Stopping:
        store.requeue_ingest(job_id)
        store.release_ingest(job_id, claim)  # before the message goes back, as a chunk's
        log.info("ingest %s: the worker is stopping; handed back before its write", job_id)
        task.hand_back(deliveries)
    except Exception as exc:
        if isinstance(exc, redis.RedisError):  # the job store's failure: run again (ingest)
            log.warning("ingest %s: Redis failed during its run; left for a redelivery", job_id)
            raise
        if task.should_retry(exc):
            store.requeue_ingest(job_id)
            store.release_ingest(job_id, claim)  # before the retry is sent, as a search's
            raise task.retry(exc=exc, countdown=task.backoff()) from exc
        if not isinstance(exc, SiftError):
            log.exception("ingest %s: unexpected error", job_id)
        error = error_info(exc)
        count_completed("ingest", store.finish_ingest(job_id, error=error), error)
        return
    lifecycle.record_size(task.context.runtime, store, job)  # before the job reads as done
    if deleting:
        count_completed("ingest", store.finish_ingest(job_id, deleted=deleted), None)
        log.info(
            "ingest %s: %s, %d documents deleted from %s", job_id, job.operation, deleted, job.index
        )
        return
    count_completed("ingest", store.finish_ingest(job_id, upserted=upserted), None)
    log.info("ingest %s: %d documents into %s", job_id, upserted, job.index)
