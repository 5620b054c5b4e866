"""Sift's Celery tasks: one search, one chunk of a batch, a batch cancel's count, one ingest
(an upsert, a delete or a drop), one index read or settings change. The webhook delivery is
:mod:`worker.queue.webhook_task`'s, the economy lane's tasks are :mod:`worker.queue.economy`'s.

Every task takes JSON ids, is idempotent (the job store's compare-and-set makes a
redelivered task a no-op for anything already final), and inherits
:class:`~worker.queue.base.SiftTask`, which times it, counts deliveries so a poison message is
failed instead of looping, and owns the retry decision: only errors marked
``retryable`` are retried, at most ``SIFT_TASK_MAX_RETRIES`` times, with
exponential backoff and jitter.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import redis
from celery import shared_task

from worker import clock
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    CANCEL_COUNT_TASK,
    ERROR_JOB_STORE_FULL,
    ERROR_UNAVAILABLE,
    INDEX_READ_TASK,
    INGEST_QUEUE,
    INGEST_TASK,
    LANE_ECONOMY,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
)
from worker.contract import ErrorInfo, SearchResult, Usage
from worker.core.budget import MIN_ATTEMPT_SECONDS
from worker.core.pipeline import load_run
from worker.errors import Canceled, HandedBack, RunTakenOver, SiftError, TenantRemoved
from worker.observability import metrics
from worker.queue import lifecycle, liveness
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.config import time_limits
from worker.queue.economy import economy_pipeline, is_prepared, maybe_submit, save_prepared
from worker.queue.items import CancelMarks, Chunk, RunOutcome
from worker.queue.jobstore import (
    BatchItem,
    BatchJob,
    ClaimAnswers,
    IngestJob,
    ItemTransition,
    JobStore,
    RunClaim,
    SearchJob,
    settle_outage,
)
from worker.redis_client import CANNOT_PERSIST, cannot_persist, unreachable

log = logging.getLogger(__name__)


def _poison_error(task: SiftTask) -> ErrorInfo:
    limit = task.context.settings.task_max_deliveries
    return ErrorInfo(
        type="delivery_limit_exceeded",
        message=f"the worker running this job was lost {limit} times; giving up",
    )


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
        poison = _billed(_poison_error(task), claim.answer)
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
            result = _with_queue_wait(result, run_started - job.created_at)
    except RunTakenOver:  # while it waited for its CPU slot: the run holding it finishes
        log.info("search %s: another run took its claim over; this run leaves it", job_id)
        return False
    except Exception as exc:
        if isinstance(exc, redis.RedisError):  # the job store's failure: run again (search)
            log.warning("search %s: Redis failed during its run; left for a redelivery", job_id)
            raise
        if task.should_retry(exc) and _retry_fits(claim, deadline):
            log.warning("search %s: retryable error, retrying: %s", job_id, exc)
            store.requeue_search(job_id)
            # let go before the retry is sent: a retry taken while this run still
            # held the claim would leave the search running with no message left
            store.release_search(job_id, claim)
            answers.record()
            raise task.retry(exc=exc, countdown=task.backoff()) from exc
        if not isinstance(exc, SiftError):
            log.exception("search %s: unexpected error", job_id)
        _with_failed_queue_wait(exc, run_started - job.created_at)
        error = _billed(error_info(exc), claim.answer)
        finished = count_completed("search", store.finish_search(job_id, error=error), error)
    else:
        finished = count_completed("search", store.finish_search(job_id, result=result), None)
    if finished:  # the run's figures of the search, once it is saved (ClaimAnswers)
        answers.record()
    return finished


def _unpace(runtime: object) -> None:
    """A batch item paced on the rate budget (the runtime's ``pace``) whose search will not
    run here counts no more in the budget's readings (the runtime's ``unpace``); a runtime
    factory's may have neither."""
    unpace = getattr(runtime, "unpace", None)
    if unpace is not None:
        unpace()


def _with_queue_wait(result: SearchResult, seconds: float) -> SearchResult:
    """``result`` with its trace (when one was asked for) telling ``queue_wait_seconds``: from
    the job's submission (a search's, or its batch's) to the start of the run that made it;
    its batch's totals count it too."""
    if result.trace is not None:
        result.trace["queue_wait_seconds"] = max(0.0, seconds)
    result._stage_seconds["queue_wait"] = max(0.0, seconds)
    return result


def _with_failed_queue_wait(exc: BaseException, seconds: float) -> None:
    """A failed search's trace (``error.trace``, when it asked for one) telling
    ``queue_wait_seconds`` as its result's would have (:func:`_with_queue_wait`)."""
    if isinstance(exc, SiftError) and exc.job_trace is not None:
        exc.job_trace["queue_wait_seconds"] = max(0.0, seconds)
    if isinstance(exc, SiftError) and exc.job_seconds is not None:
        exc.job_seconds["queue_wait"] = max(0.0, seconds)


def _kept_usage(answer: str) -> Usage | None:
    """The usage of a model answer a dead run kept in its claim (``answer``; '' : none; one
    that cannot be read is logged and shows none: the job still ends)."""
    if not answer:
        return None
    try:
        return load_run(json.loads(answer)).job_usage()
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("a kept model answer could not be read: %s", exc)
        return None


def _billed(error: ErrorInfo, answer: str) -> ErrorInfo:
    """``error``, with the usage of the model answer a dead run kept (``answer``, its
    claim's) when it has none of its own: that call was billed, and this run failed before it
    could apply it (its retrieval), or none ran (the poison path), so the failure is the only
    record that can show it."""
    kept = _kept_usage(answer)
    if error.usage is not None or kept is None:
        return error
    return error.model_copy(update={"usage": kept})


def _unbilled(usage: Usage | None) -> bool:
    """Whether ``usage`` (a run's, or a dead run's kept) read no token: no call sent, or each
    refused (a 429, a 529: the provider bills nothing) or timed out unanswered (what the
    provider may bill for it no usage says either way: counted unread).

    >>> _unbilled(None), _unbilled(Usage(requests=2)), _unbilled(Usage(requests=1, input_tokens=9))
    (True, True, False)
    """
    if usage is None:
        return True
    tokens = usage.input_tokens + usage.output_tokens
    return tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == 0


def _retry_fits(claim: RunClaim, deadline: float) -> bool:
    """Whether a task retry would have any of the search's one deadline left to run in: a
    retry runs in what is left of it, never in a deadline of its own (the wait before the
    retry is not counted, as the queue wait before the first run is not)."""
    return deadline - claim.spent_now() >= MIN_ATTEMPT_SECONDS


@dataclass
class _ModelCheck:
    """The hook a batch item's search runs just before its model call, and again before
    each retry of it and after each wait for the rate budget. If the process's
    view of the batch's cancel mark (:class:`CancelMarks`, no round trip of its own most of
    the time) says canceled, one job-store transition (:meth:`JobStore.check_item`) cancels
    the item, atomically, and the search stops (``stopped`` says how it ended). If instead
    the worker is stopping (``stopping``) and no call of the item read a token (none sent,
    or each refused, a 429, a 529, or timed out unanswered), by this run or any before it, the
    search stops with :class:`HandedBack`: it goes back to its chunk (``kept``: this run had
    sent calls, kept in its claim for the run that takes it on). It is asked before the
    first call too, and every second of any wait before a call (the rate budget, the
    provider's outage, a 429's pause, the back-off between attempts)."""

    store: JobStore
    marks: CancelMarks
    batch_id: str
    query_id: str
    stopping: Callable[[], bool] | None = None
    stopped: ItemTransition | None = None
    billed: Usage | None = None  # a dead run's kept answer (for other candidates): paid
    kept: bool = False

    def __call__(self, billed: Usage | None) -> None:
        """``billed``: what this run's model calls were billed so far (the check runs again
        before each retry), on the canceled record with a dead run's kept answer's."""
        if self.marks.canceled(self.batch_id):
            self._cancel(billed)
        elif _unbilled(billed) and _unbilled(self.billed) and self.stopping and self.stopping():
            self.kept = billed is not None
            raise HandedBack(f"item {self.query_id} stopped before its model call")

    def _cancel(self, billed: Usage | None) -> None:
        usage = self.billed
        if billed is not None:
            usage = billed if usage is None else usage + billed
        check = self.store.check_item(self.batch_id, self.query_id, usage=usage)
        if check.canceled or not check.applied:
            self.stopped = check
            raise Canceled(f"item {self.query_id} stopped before its model call")


@shared_task(  # type: ignore[untyped-decorator]
    name=BATCH_CHUNK_TASK, base=SiftTask, bind=True
)
def batch_chunk(self: SiftTask, batch_id: str, start: int, stop: int) -> None:
    """Run the batch items at positions [start, stop); skip canceled or finished ones."""
    store = self.context.store
    batch = store.get_batch(batch_id)
    if batch is None:
        log.warning("batch %s: missing, chunk [%d, %d) dropped", batch_id, start, stop)
        return
    # claimed first, as a search is: a copy delivered while another live run holds the chunk
    # (kombu's restore at a broker reconnect, a re-drive) writes nothing and is no poison (its
    # worker is not lost): counted, a copy past the limit failed the items that run had not
    # reached yet. Leased for the chunk's hard time limit, the longest a run of it may run
    lease = time_limits(self.context.settings)[BATCH_CHUNK_TASK][1]
    chunk_claim = store.claim_chunk(
        batch_id, start, stop, liveness.run_owner(), lease_seconds=lease
    )
    if not chunk_claim.granted:  # another delivery is running it (jobstore/runs.py)
        log.info(
            "batch %s: another run holds chunk [%d, %d); this delivery leaves it",
            batch_id,
            start,
            stop,
        )
        return
    try:
        _batch_chunk(self, batch, start, stop, chunk_claim)
    finally:  # (one handed back or retried let go before its message went: nothing to do)
        store.release_chunk(batch_id, start, stop, chunk_claim)


def _batch_chunk(
    task: SiftTask, batch: BatchJob, start: int, stop: int, chunk_claim: RunClaim
) -> None:
    """Run the batch chunk [start, stop) of ``batch`` under the chunk's run ``chunk_claim``."""
    chunk_items = _ChunkItems(task, batch, start, stop)
    pending = [item for item in chunk_items.items if not item.status.final]
    chunk = Chunk(
        batch.id,
        chunk_items.to_start,
        chunk_items.run,
        chunk_items.finished,
        (chunk_items.owner, chunk_items.deadline),
    )
    chunk = task.context.items.run(chunk, pending)
    try:
        if chunk.error is not None and unreachable(chunk.error):
            # Redis unreachable broke a runner: once it answers, the answers the runs hold
            # unkept are kept, and the items this run leaves unfinished go back by a re-drive
            # that is the outage's, not theirs (noted)
            positions = [chunk_items.positions[item.query_id] for item in pending]
            held = list(chunk_items.held.values())
            delivery = task.delivered()
            settle_outage(task.context.store, batch.id, positions, held, delivery=delivery)
    finally:
        chunk_items.end_unfinished()
    _end_chunk(task, batch, start, stop, chunk_claim, chunk, pending, chunk_items.deliveries)


class _ChunkItems:
    """One run of a batch chunk's items: what its item threads share, how each item starts,
    runs (a poisoned chunk's, an economy item's first half, a standard item's search) and
    finishes, and the error policy of an item's run."""

    def __init__(self, task: SiftTask, batch: BatchJob, start: int, stop: int) -> None:
        self.task, self.batch = task, batch
        self.store, self.batch_id = task.context.store, batch.id
        query_ids = self.store.batch_query_ids(self.batch_id, start, stop)
        self.positions = {qid: start + i for i, qid in enumerate(query_ids)}
        self.items = self.store.batch_items(self.batch_id, query_ids)
        self.deliveries = task.delivery(batch.id)
        self.economy = batch.lane == LANE_ECONOMY
        self.owner = liveness.run_owner()
        # A standard item fails as poison by its own runs lost (its claim's ``lost``), never by
        # its chunk's deliveries: a worker holds many more chunks than it runs items, and each
        # worker lost counted a delivery of every chunk it held, failing items that never ran.
        # An economy item's first half claims no run, and a claim naming no owner (a prefork
        # child's) tells no lost run from a gone one: their chunk's deliveries judge them.
        self.poisoned = (self.economy or not self.owner) and task.poisoned(self.deliveries)
        self.limit = task.context.settings.task_max_deliveries
        # task.request is thread-local: take what the item threads need from it here
        self.may_retry = task.request.retries < task.context.settings.task_max_retries
        self.deadline = task.context.settings.search_deadline_seconds
        self.runtime = task.context.runtime if not self.poisoned else None
        self.marks = task.context.cancel_marks
        self.stopping = task.context.items.stopping
        self.admit = partial(task.context.admit, batch.tenant)
        # each running item's, until its finish (ClaimAnswers)
        self.held: dict[str, ClaimAnswers] = {}
        # an economy item's first-half figures (its retrieval's, a final result's), recorded once
        # its prepared search is saved, or, when its first half was final, once it is finished
        self.later: dict[str, list[Callable[[], None]]] = {}

    def to_start(self, item: BatchItem) -> str | None:
        """The item's query id if it is to be started (a poisoned chunk fails, unstarted,
        those no live run holds, and an item without its spec has expired)."""
        return None if self.poisoned or item.spec is None else item.query_id

    def run(self, item: BatchItem, started: bool) -> RunOutcome:
        """Run one item: the result or error to finish it with, ``"retry"`` (requeued for
        the chunk's retry), the transition that canceled it (its batch was canceled before
        its model call), or None (nothing to finish: not started, finished by another
        delivery, or left to the economy lane's provider batch)."""
        if self.poisoned:  # claimed first, as a search is: one a live run holds is that run's
            return self._run_poisoned(item)
        if not started:
            return None  # canceled meanwhile, or finished by another delivery
        waited = clock.now() - self.batch.created_at
        assert self.runtime is not None and item.spec is not None
        checked = _ModelCheck(self.store, self.marks, self.batch_id, item.query_id, self.stopping)
        item_claim: RunClaim | None = None
        try:
            self.admit()  # a removed tenant's item ends here, unrun (either lane), unpaced
        except TenantRemoved as exc:
            return None, error_info(exc)
        try:
            with metrics.running_job():
                # an economy item's first half now; the model's answer comes from a provider batch
                if self.economy:
                    return self._run_first_half(item, waited)
                pace = getattr(self.runtime, "pace", None)  # a runtime factory's may have none
                if pace is not None:  # wait for the shared rate budget before the deadline
                    pace(self.stopping)  # starts (until the worker stops)
                item_claim = self.store.claim_item(
                    self.batch_id, item.query_id, self.owner, lease_seconds=self.deadline
                )
                return self._run_standard(item, item_claim, checked, waited)
        except Canceled:  # canceled before its model call, or finished by another delivery
            return checked.stopped if checked.stopped and checked.stopped.applied else None
        except HandedBack:  # the worker is stopping, and nothing was billed: it goes back
            return self._handed_back(item, item_claim, checked.kept)
        except RunTakenOver:  # while it waited for its CPU slot: the run holding it finishes
            log.info("batch %s item %s: another run took it over", self.batch_id, item.query_id)
            return None
        except Exception as exc:
            if item_claim is None:  # paced, or not, but no search ran
                _unpace(self.runtime)
            if isinstance(exc, redis.RedisError):
                # the job store (Redis, past its client's retries) failed, not the item:
                # before its run began (its claim, its pacing on the shared budget, an
                # economy first half not kept) or during it (its cancel check, its index's
                # settings, the rate budget). The runner breaks, as when an item's start
                # fails, and the item stays running for a redelivery (the re-drive) instead
                # of ending failed internal_error once Redis is back for the finish. A claim
                # taken stays in Redis as it is (this run ends here: end_unfinished), so
                # the copy takes it over uncharged and finishes on the answer kept in it
                log.warning(
                    "batch %s item %s: Redis failed during its run; left for a redelivery",
                    self.batch_id, item.query_id,
                )  # fmt: skip
                raise
            return self._run_failed(item, item_claim, exc, waited)

    def _run_poisoned(self, item: BatchItem) -> RunOutcome:
        """An item of a poisoned chunk: failed as poison (billed for a model answer a dead run
        kept), canceled if its batch was, or left to the run or provider batch that has it."""
        store, batch_id = self.store, self.batch_id
        if self.economy and is_prepared(store, batch_id, item.query_id):
            # its first half kept (its prompt may be with the provider): the submission
            # and its provider batch finish it, as they do when a copy's start is refused
            return None
        item_claim = store.claim_item(
            batch_id, item.query_id, self.owner, lease_seconds=self.deadline
        )
        if not item_claim.granted:
            log.info("batch %s item %s: another run holds it", batch_id, item.query_id)
            return None
        self.held[item.query_id] = store.item_answers(batch_id, item.query_id, item_claim)
        if not item_claim.answer and store.batch_canceled(batch_id):
            # its batch canceled (it was running then, and requeued for a retry since):
            # canceled, as the start of any delivery short of this one would have it
            canceled = store.cancel_item(batch_id, item.query_id)
            return replace(canceled, canceled=True)
        # with the usage of a model answer a dead run kept: billed
        return None, _billed(_poison_error(self.task), item_claim.answer)

    def _run_first_half(self, item: BatchItem, waited: float) -> RunOutcome:
        """An economy item's first half (retrieval and prompt), kept for its provider batch;
        a first half that is final already (no model call) is the item's result."""
        store, batch_id = self.store, self.batch_id
        assert item.spec is not None
        if is_prepared(store, batch_id, item.query_id):
            return None  # by an earlier run of this chunk: its prompt may be out
        # its wait is counted with its first half's figures: once, by the run
        # whose first half is kept (a run retried, its retry message lost and
        # re-driven, counted it again as a first delivery)
        figures = self.later[item.query_id] = [
            partial(metrics.observe_queue_wait, BATCH_QUEUE, waited)
        ]
        prepared = economy_pipeline(self.task).prepare(item.spec, self.batch.tenant, later=figures)
        prepared.trace["queue_wait_seconds"] = max(0.0, waited)  # kept for finish
        if prepared.result is None:
            position = self.positions[item.query_id]
            if save_prepared(store, batch_id, item.query_id, position, prepared):
                for record in self.later.pop(item.query_id):  # once: the one kept
                    record()
            return None
        return _with_queue_wait(prepared.result, waited), None

    def _run_standard(
        self, item: BatchItem, item_claim: RunClaim, checked: _ModelCheck, waited: float
    ) -> RunOutcome:
        """A standard item's search under its run claim ``item_claim`` (paced already), or
        nothing if another run holds it, or poison if its own runs were lost that often."""
        store, batch_id, runtime = self.store, self.batch_id, self.runtime
        assert runtime is not None and item.spec is not None
        if not item_claim.granted:  # another delivery is running it (jobstore/runs.py)
            log.info("batch %s item %s: another run holds it", batch_id, item.query_id)
            _unpace(runtime)  # it let this one start: no search of it runs here
            return None
        if item_claim.lost >= self.limit:  # its own runs lost that often: poison
            log.error(
                "batch %s item %s: its run was lost %d times; failing it as poison",
                batch_id, item.query_id, item_claim.lost,
            )  # fmt: skip
            _unpace(runtime)
            self.held[item.query_id] = store.item_answers(batch_id, item.query_id, item_claim)
            # with the usage of a model answer a dead run kept: billed
            return None, _billed(_poison_error(self.task), item_claim.answer)
        if item.status == "queued" and not item_claim.spent:
            # its first run: one requeued for a retry let its claim go with the time
            # it ran, so a re-driven chunk (its retry message lost, retries 0) that
            # finds it queued does not count its wait again
            metrics.observe_queue_wait(BATCH_QUEUE, waited)
        answers = self.held[item.query_id] = store.item_answers(
            batch_id, item.query_id, item_claim, self.stopping
        )
        checked.billed = _kept_usage(item_claim.answer)
        result = runtime.search(
            item.spec, self.batch.tenant, checked, spent=item_claim.spent, answers=answers
        )
        return _with_queue_wait(result, waited), None

    def _handed_back(
        self, item: BatchItem, item_claim: RunClaim | None, kept: bool = False
    ) -> RunOutcome:
        """An item stopped before its model call because its worker is stopping: queued
        again, its claim let go (the run ended cleanly: no run lost, none counted toward the
        poison limit), for the worker that takes the chunk's message next. Its reservation
        and its place in the budget's queue were given back where it stopped. Left waiting,
        it held the stop up to its deadline, and the worker exited as after a crash. One
        whose claim keeps calls (``kept``: this run's, none read; or an earlier run's)
        stays running, as a retry of it does: a cancel meanwhile shows them."""
        store, batch_id = self.store, self.batch_id
        if item_claim is None or not (item_claim.answer or kept):  # else it stays running
            store.requeue_item(batch_id, item.query_id)
        if item_claim is not None:  # its time uncharged: the next run starts it again whole
            store.release_item(batch_id, item.query_id, item_claim, counted=False)
            answers = self.held.pop(item.query_id, None)
            if answers is not None:  # its retrieval ran
                answers.record()
        log.info("batch %s item %s: the worker is stopping; handed back before its model call",
                 batch_id, item.query_id)  # fmt: skip
        return "handed_back"

    def _run_failed(
        self, item: BatchItem, item_claim: RunClaim | None, exc: Exception, waited: float
    ) -> RunOutcome:
        """The error policy of an item's run that raised ``exc`` (``item_claim``: its run claim,
        None for an economy first half or a claim never made): ``"retry"`` (requeued for the
        chunk's retry) if it is retryable and fits the search's deadline, else failed."""
        store, batch_id = self.store, self.batch_id
        retryable = self.may_retry and isinstance(exc, SiftError) and exc.retryable
        # a retry runs in what is left of the search's deadline (the economy lane's first
        # half, claimed by no run, is retried as it was)
        if retryable and (item_claim is None or _retry_fits(item_claim, self.deadline)):
            # one that carries a model answer a dead run kept stays running: it is past
            # its model call, paid for, and its retry finishes it on that answer, or, for
            # billed attempts alone, calls again showing them billed (queued, a cancel
            # meanwhile canceled it, and no record showed the calls billed)
            if item_claim is None or not item_claim.answer:
                store.requeue_item(batch_id, item.query_id)
            if item_claim is not None:
                store.release_item(batch_id, item.query_id, item_claim)
                self.held.pop(item.query_id).record()
            return "retry"
        if not isinstance(exc, SiftError):
            log.exception("batch %s item %s: unexpected error", batch_id, item.query_id)
        _with_failed_queue_wait(exc, waited)
        return None, _billed(error_info(exc), item_claim.answer if item_claim else "")

    def finished(
        self, item: BatchItem, transition: ItemTransition, error: ErrorInfo | None
    ) -> None:
        answers = self.held.pop(item.query_id, None)
        if answers is not None:  # its run has ended: its claim is no longer held here
            self.store.ended_item(self.batch_id, item.query_id, answers.claim)
        figures = self.later.pop(item.query_id, [])
        if not transition.canceled:
            if count_completed("batch_item", transition.applied, error):
                if answers is not None:
                    answers.record()  # the run's figures of the search, once it is saved
                for record in figures:  # an economy item's final first half's, likewise
                    record()
        elif transition.applied:
            metrics.job_completed("batch_item", "canceled")
            if answers is not None:  # canceled before its model call: its retrieval ran
                answers.record()

    def end_unfinished(self) -> None:
        """Let go of the runs that ended without a finish (a copy's)."""
        for query_id, stopped in self.held.items():
            self.store.ended_item(self.batch_id, query_id, stopped.claim)


def _end_chunk(
    task: SiftTask,
    batch: BatchJob,
    start: int,
    stop: int,
    chunk_claim: RunClaim,
    chunk: Chunk,
    pending: list[BatchItem],
    deliveries: int,
) -> None:
    """After a chunk's items ran: its batch's completion (or its webhook sent again), an
    economy batch's submission, then the runner's error raised, the items handed back, or the
    chunk retried."""
    store, batch_id = task.context.store, batch.id
    economy = batch.lane == LANE_ECONOMY
    outcomes = chunk.outcomes
    completed = any(done for done, _ in outcomes)
    to_retry = sum(1 for _, retry in outcomes if retry)
    # A redelivered chunk with nothing left to run, of a finished batch: the worker that
    # completed the batch may have died before enqueueing its webhook, so send it again
    # while that is possible (owed, no retry of it recorded: JobStore.webhook_unattempted).
    resend = deliveries > 1 and not pending and batch.finished_at is not None
    resend = resend and store.webhook_unattempted(batch_id)
    if completed or resend:
        log.info("batch %s: completed%s", batch_id, " (webhook sent again)" if resend else "")
        done = store.get_batch(batch_id)
        status = done.status.value if done else "succeeded"
        if completed:
            metrics.job_completed("batch", status)  # once: only one transition completes it
        task.announce_batch(batch, status)
    if economy and not to_retry and not chunk.handed_back:
        # even when a runner broke: an item it left prepared (the write landed, its reply
        # was lost) may be the batch's last to settle, and no re-drive comes for a prepared
        # item, nor any watch for a submission never enqueued
        maybe_submit(task, batch_id)
    if chunk.error is not None:  # a runner broke: fail the task (its completion is sent)
        raise chunk.error
    if chunk.handed_back:
        log.info("batch %s: worker stopping, %d items handed back", batch_id, chunk.handed_back)
        # let go before the message goes back: another worker takes it at once, and would be
        # refused while this live worker still held the chunk (its copy then acked, and lost)
        store.release_chunk(batch_id, start, stop, chunk_claim)
        task.hand_back(deliveries)
    if to_retry:
        log.warning(
            "batch %s: %d items hit retryable errors; retrying the chunk", batch_id, to_retry
        )
        # before the retry is sent, as a search's
        store.release_chunk(batch_id, start, stop, chunk_claim)
        raise task.retry(countdown=task.backoff())


@shared_task(  # type: ignore[untyped-decorator]
    name=CANCEL_COUNT_TASK, base=SiftTask, bind=True
)
def cancel_count(self: SiftTask, batch_id: str) -> None:
    """Count what a batch's cancel ended that its gateway did not (the cancel wrote this
    message with it, in one script: counted even when the gateway never heard the cancel's
    answer, or died before it counted). Taken from the batch's record, so what the gateway
    took, a second delivery, or a second cancel's message counts nothing more."""
    metrics.cancel_counted(*self.context.store.take_cancel_count(batch_id))


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


def _ingest(task: SiftTask, job: IngestJob, claim: RunClaim) -> None:
    """Run the ingest ``job`` under its run ``claim``."""
    store, job_id = task.context.store, job.id
    if task.poisoned(job_id=job_id):
        count_completed(
            "ingest", store.finish_ingest(job_id, error=_poison_error(task)), _poison_error(task)
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
                job.index, job.tenant, documents, version=job.version
            )
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


def job_store_error(exc: BaseException) -> dict[str, str] | None:
    """The answer to an index read whose run met Redis failing: the gateway's own 503 of
    the job store (``job_store_full`` at Redis's maxmemory or unable to persist to its disk,
    ``unavailable`` down or silent), not an ``internal_error`` it told its client as the
    search backend's ``backend_unavailable``. None for any other error, a bug's. Redis's
    text names its host and port: the log has it, the answer says what failed.

    >>> job_store_error(redis.TimeoutError("Timeout reading from 10.0.0.5:6379"))["message"]
    'Redis did not answer the worker in time'
    >>> job_store_error(redis.ResponseError("WRONGTYPE Operation against a key")) is None
    True
    """
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return {"type": ERROR_JOB_STORE_FULL, "message": "Redis reached its maxmemory"}
    if cannot_persist(exc):
        return {"type": ERROR_JOB_STORE_FULL, "message": CANNOT_PERSIST}
    if isinstance(exc, redis.TimeoutError):
        return {"type": ERROR_UNAVAILABLE, "message": "Redis did not answer the worker in time"}
    if isinstance(exc, redis.ConnectionError):
        return {"type": ERROR_UNAVAILABLE, "message": "the worker could not reach Redis"}
    return None


@shared_task(  # type: ignore[untyped-decorator]
    name=INDEX_READ_TASK, base=SiftTask, bind=True
)
def index_read(
    self: SiftTask,
    reply_key: str,
    operation: str,
    tenant: str,
    index: str,
    doc_id: str,
    body: str = "",
    start_by: float = 0.0,
) -> None:
    """Answer one index read (list, show, a document) or settings change (``update``, with
    its patch as ``body``) on ``reply_key`` (first, so the logs name the read by it). Never
    retried: the gateway waits a few seconds for the answer, then answers 503, and the
    client asks again (a change is a merge patch: applying it twice changes nothing more).
    A change not started by ``start_by`` (epoch seconds on Redis's clock, ``TIME``: the
    gateway's host and this one may disagree by seconds) is dropped unapplied: its gateway
    has answered 503 or is about to, and a later change may have been made since; so is one
    that has not had its index's settings lock by then. Redis failing is answered as the
    job store's failure wherever it comes, in reading its clock for ``start_by`` too (that
    one dropped the change unanswered, and its gateway waited out its 13 s to say no worker
    answered); only the answer's own write can tell no one, so it is logged. A read carries
    its ``start_by`` too, the end of its gateway's wait: one taken later (a backlog, a
    worker started late) is dropped unrun, logged and counted
    (``sift_index_reads_dropped_total``), as no one waits for its answer any more."""
    try:
        if start_by and self.context.store.server_time() > start_by:
            log.warning(
                "index %s for %s/%s came after its gateway gave up; dropped",
                operation,
                tenant,
                index,
            )
            metrics.index_read_dropped(operation)
            return
        self.context.admit(tenant)  # a removed tenant's index is not read nor changed either
        runtime = self.context.runtime
        answer = lifecycle.read(runtime, operation, tenant, index, doc_id, body, start_by)
    except TenantRemoved as exc:  # the gateway answers it 503, naming the removal
        answer = json.dumps({"error": {"type": exc.code, "message": str(exc)}})
    except Exception as exc:  # the gateway must hear something, not time out
        if (error := job_store_error(exc)) is not None:
            log.warning("index read %s for %s: the job store failed: %r", operation, tenant, exc)
        else:
            log.exception("index read %s for %s: unexpected error", operation, tenant)
            error = {"type": "internal_error", "message": error_info(exc).message}
        answer = json.dumps({"error": error})
    try:
        self.context.store.reply(reply_key, answer)
    except redis.RedisError as exc:  # nothing left to tell the gateway with: its wait ends in 503
        log.warning(
            "index read %s for %s: its answer on %s could not be sent: %r",
            operation,
            tenant,
            reply_key,
            exc,
        )
