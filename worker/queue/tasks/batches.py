"""The batch tasks: one chunk of a batch's items, run under the chunk's claim (each item's
search, or an economy item's first half), and a batch cancel's count."""

from __future__ import annotations

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
    LANE_ECONOMY,
)
from worker.contract import ErrorInfo, Usage
from worker.errors import Canceled, HandedBack, RunTakenOver, SiftError, TenantRemoved
from worker.observability import metrics
from worker.queue import liveness
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.config import time_limits
from worker.queue.economy import economy_pipeline, is_prepared, maybe_submit, save_prepared
from worker.queue.items import CancelMarks, Chunk, RunOutcome
from worker.queue.jobstore import (
    BatchItem,
    BatchJob,
    ClaimAnswers,
    ItemTransition,
    JobStore,
    RunClaim,
    settle_outage,
)
from worker.queue.tasks._runs import (
    billed_error,
    kept_usage,
    poison_error,
    retry_fits,
    unbilled,
    unpace_runtime,
    with_failed_queue_wait,
    with_queue_wait,
)
from worker.redis_client import unreachable

log = logging.getLogger(__name__)


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
        elif unbilled(billed) and unbilled(self.billed) and self.stopping and self.stopping():
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
    if _nothing_left(store, batch):
        log.debug("batch %s: finished, chunk [%d, %d) has nothing to run", batch_id, start, stop)
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


def _nothing_left(store: JobStore, batch: BatchJob) -> bool:
    """Whether a chunk of ``batch`` has nothing to do: the batch has finished (every item
    final: a cancel's chunks still queued, 4,000 of a 100,000-query batch) and its webhook is
    not owed unattempted (a redelivered chunk sends that one again: :func:`_end_chunk`). Such a
    chunk went through its claim, its delivery count and its items' reads for nothing, and the
    batches sent after a big one canceled waited behind its thousands of chunks. An economy
    batch's chunk still goes the whole way: its lane's submission check runs at every
    chunk's end (:func:`~worker.queue.economy.maybe_submit`)."""
    if batch.finished_at is None or batch.lane == LANE_ECONOMY:
        return False
    return not store.webhook_unattempted(batch.id)


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
                reranks = getattr(self.runtime, "reranks", None)
                # an item that asks the model waits for the shared rate budget before its
                # deadline starts (until the worker stops, or the batch's cancel ends the
                # wait); one that does not never waits on it (while no limit is known, for
                # the call out learning them)
                if pace is not None and (reranks is None or reranks(item.spec)):
                    pace(self.stopping, partial(self.marks.canceled, self.batch_id))
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
                unpace_runtime(self.runtime)
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
        return None, billed_error(poison_error(self.task), item_claim.answer)

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
        return with_queue_wait(prepared.result, waited), None

    def _run_standard(
        self, item: BatchItem, item_claim: RunClaim, checked: _ModelCheck, waited: float
    ) -> RunOutcome:
        """A standard item's search under its run claim ``item_claim`` (paced already), or
        nothing if another run holds it, or poison if its own runs were lost that often."""
        store, batch_id, runtime = self.store, self.batch_id, self.runtime
        assert runtime is not None and item.spec is not None
        if not item_claim.granted:  # another delivery is running it (jobstore/runs.py)
            log.info("batch %s item %s: another run holds it", batch_id, item.query_id)
            unpace_runtime(runtime)  # it let this one start: no search of it runs here
            return None
        if item_claim.lost >= self.limit:  # its own runs lost that often: poison
            log.error(
                "batch %s item %s: its run was lost %d times; failing it as poison",
                batch_id, item.query_id, item_claim.lost,
            )  # fmt: skip
            unpace_runtime(runtime)
            self.held[item.query_id] = store.item_answers(batch_id, item.query_id, item_claim)
            # with the usage of a model answer a dead run kept: billed
            return None, billed_error(poison_error(self.task), item_claim.answer)
        if item.status == "queued" and not item_claim.spent:
            # its first run: one requeued for a retry let its claim go with the time
            # it ran, so a re-driven chunk (its retry message lost, retries 0) that
            # finds it queued does not count its wait again
            metrics.observe_queue_wait(BATCH_QUEUE, waited)
        answers = self.held[item.query_id] = store.item_answers(
            batch_id, item.query_id, item_claim, self.stopping
        )
        checked.billed = kept_usage(item_claim.answer)
        result = runtime.search(
            item.spec, self.batch.tenant, checked, spent=item_claim.spent, answers=answers
        )
        return with_queue_wait(result, waited), None

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
        if retryable and (item_claim is None or retry_fits(item_claim, self.deadline)):
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
        with_failed_queue_wait(exc, waited)
        return None, billed_error(error_info(exc), item_claim.answer if item_claim else "")

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
