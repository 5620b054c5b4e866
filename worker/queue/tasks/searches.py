"""The search task: one search job, run under its claim, its result or typed error stored."""

from __future__ import annotations

import logging

import redis
from celery import shared_task

from worker import clock
from worker.constants import (
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
)
from worker.errors import RunTakenOver, SiftError
from worker.observability import metrics
from worker.queue import liveness
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.jobstore import (
    ClaimAnswers,
    RunClaim,
    SearchJob,
    settle_outage,
)
from worker.queue.tasks._runs import (
    billed_error,
    poison_error,
    retry_fits,
    with_failed_queue_wait,
    with_queue_wait,
)
from worker.redis_client import unreachable

log = logging.getLogger(__name__)


@shared_task(  # type: ignore[untyped-decorator]
    name=SEARCH_TASK, base=SiftTask, bind=True
)
def search(self: SiftTask, job_id: str) -> None:
    """Run one search job and store its result or typed error."""
    store = self.context.store
    job = store.get_search(job_id)
    if job is None or job.status.final:
        log.info("search %s: nothing to do (%s)", job_id, "missing" if job is None else "final")
        if job is not None and job.webhook_url and store.webhook_unattempted(job_id):
            # a redelivery: the worker that finished it may have died before enqueueing the
            # webhook. Send it again; the webhook-id is the same, delivery is at least once,
            # and if the first is on its way this copy waits for its claim of the attempt
            self.send_webhook(
                WEBHOOK_EVENT_SEARCH_COMPLETED,
                job_id,
                job.tenant,
                job.webhook_url,
                job.status.value,
            )
        return
    deadline = self.context.settings.search_deadline_seconds
    # claimed first, as an ingest is: a copy delivered while another live run holds the
    # search (kombu's restore at a broker reconnect, a re-drive) writes nothing, not even its
    # start, and is no poison (its worker is not lost): counted, a copy at the limit failed
    # the search under the live run, whose result was then refused
    claim = store.claim_search(job_id, liveness.run_owner(), lease_seconds=deadline)
    if not claim.granted:  # another delivery is running it (jobstore/runs.py)
        log.info("search %s: another run holds it; this delivery leaves it", job_id)
        return  # before its start: its record's started_at and status are that run's
    answers = store.search_answers(job_id, claim)
    try:
        finished = _search(self, job, claim, answers)
    except redis.RedisError as exc:
        # the job store (Redis) failed, not the search: it stays running for its redelivery
        # (the re-drive), and its claim stays in Redis as it is, this run ended here alone
        # (not let go: that would charge the outage to the search's one deadline). The copy
        # takes the claim over uncharged, at once on this worker and past its lease on
        # another, and finishes on the model's answer kept in it, if there is one. Redis
        # unreachable, once it answers the answer this run holds unkept is kept, and the
        # outage noted: that re-drive is not counted
        try:
            if unreachable(exc):
                settle_outage(store, job_id, [0], [answers], delivery=self.delivered())
        finally:
            store.ended_search(job_id, claim)
        raise
    else:  # after the finish: a run that starts meanwhile finds the search final
        # (a retry let go before it was sent: this release then finds nothing to do)
        store.release_search(job_id, claim)
    if finished:
        final = store.get_search_status(job_id)
        log.info("search %s: %s", job_id, final)
        if job.webhook_url and final is not None:
            self.send_webhook(
                WEBHOOK_EVENT_SEARCH_COMPLETED, job_id, job.tenant, job.webhook_url, final.value
            )


def _search(task: SiftTask, job: SearchJob, claim: RunClaim, answers: ClaimAnswers) -> bool:
    """Run the search ``job`` under its run ``claim`` (``answers``: where it keeps its model's
    answer); answers whether this run finished it."""
    store, job_id = task.context.store, job.id
    if task.poisoned(job_id=job_id):  # with the usage of a model answer a dead run kept: billed
        poison = billed_error(poison_error(task), claim.answer)
        return count_completed("search", store.finish_search(job_id, error=poison), poison)
    if not store.start_search(job_id):  # final meanwhile (or gone)
        return False
    if job.started_at is None and not claim.spent:
        # its first run (the record read before the claim may predate a run that has
        # started, been retried and let go: that run counted the wait)
        metrics.observe_queue_wait(SEARCH_QUEUE, clock.now() - job.created_at)
    log.info("search %s: running for tenant %s", job_id, job.tenant)
    deadline = task.context.settings.search_deadline_seconds
    run_started = clock.now()  # created_at's clock: the gateway's host may not be this one
    try:
        task.context.admit(job.tenant)  # a removed tenant's search ends here, unrun
        with metrics.running_job():
            result = task.context.runtime.search(
                job.spec, job.tenant, spent=claim.spent, answers=answers
            )
            result = with_queue_wait(result, run_started - job.created_at)
    except RunTakenOver:  # while it waited for its CPU slot: the run holding it finishes
        log.info("search %s: another run took its claim over; this run leaves it", job_id)
        return False
    except Exception as exc:
        if isinstance(exc, redis.RedisError):  # the job store's failure: run again (search)
            log.warning("search %s: Redis failed during its run; left for a redelivery", job_id)
            raise
        if task.should_retry(exc) and retry_fits(claim, deadline):
            log.warning("search %s: retryable error, retrying: %s", job_id, exc)
            store.requeue_search(job_id)
            # let go before the retry is sent: a retry taken while this run still
            # held the claim would leave the search running with no message left
            store.release_search(job_id, claim)
            answers.record()
            raise task.retry(exc=exc, countdown=task.backoff()) from exc
        if not isinstance(exc, SiftError):
            log.exception("search %s: unexpected error", job_id)
        with_failed_queue_wait(exc, run_started - job.created_at)
        error = billed_error(error_info(exc), claim.answer)
        finished = count_completed("search", store.finish_search(job_id, error=error), error)
    else:
        finished = count_completed("search", store.finish_search(job_id, result=result), None)
    if finished:  # the run's figures of the search, once it is saved (ClaimAnswers)
        answers.record()
    return finished
