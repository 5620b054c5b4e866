"""The economy lane: a batch's reranks sent as Anthropic Message Batches, at half the price.

The flow (DESIGN.md §7; the README's "Choosing a lane"):

1. ``sift.batch_chunk`` runs each item's first half, :meth:`SearchPipeline.prepare`, on the
   runtime's economy pipeline: retrieval and fusion as in the standard lane. An item that
   needs no model call is finished there. The others' prepared state goes to
   ``sift:eco-prepared:<batch>``, and the item stays ``running``. The chunk that finds every
   item final or prepared enqueues ``sift.economy_submit``, once.
2. ``sift.economy_submit`` sends the prompts as Message Batches, chunked under the
   provider's limits (``SIFT_ECONOMY_MAX_REQUESTS_PER_BATCH``, 100,000 requests, and
   ``SIFT_ECONOMY_MAX_BATCH_BYTES``, 256 MB). Each request's ``custom_id`` is
   ``i<position>-<submission>``: the item's place in the submission order, and the token of
   the create that sent it; its ``params`` are the standard lane's own. Each create is
   written down before it is made, so that one whose answer was lost is found, not made
   twice (:func:`settle_doubts`). A failed call is retried at the poll cadence until the
   economy deadline. One ``sift.economy_poll`` per provider batch follows.
3. ``sift.economy_poll`` retrieves its provider batch with backoff
   (``SIFT_ECONOMY_POLL_SECONDS`` doubling up to ``SIFT_ECONOMY_POLL_MAX_SECONDS``) until it
   ended, then streams the JSONL results, in whatever order they come, and maps each line
   back by its ``custom_id`` (a line counts only if it names the item's current submission,
   and once):

   - ``succeeded``: the pipeline's second half, :meth:`SearchPipeline.finish`, with the
     model's positions: the same normalisation and fallback as the standard lane;
   - ``errored`` (its class from the error type), ``expired`` (class ``timeout``) and a
     ``succeeded`` answer that fails the schema or has more positions than the request's
     ``max_tokens`` lets a model write (the standard lane's check), or a line of an unknown
     shape (``malformed``): resubmitted in a new
     provider batch while the class is retryable, the attempt budget
     (``SIFT_GENERATION_MAX_REQUESTS``) lasts and ``SIFT_ECONOMY_DEADLINE_SECONDS`` since
     the batch was submitted has not passed; else the failure policy, as in the standard
     lane (``fail_closed``: the item fails with ``rerank_failed`` naming the class;
     ``fail_open``: coarse top-k with ``fallback_reason``);
   - ``canceled``: the item is canceled.
4. ``DELETE /v1/batches/{id}`` enqueues ``sift.economy_cancel``, which cancels the batch's
   provider batches (a poll does too, should it find the Sift batch canceled); their
   unprocessed requests come back ``canceled``.

The Sift batch completes, and its webhook fires, when its last item is final: when the
results of its last provider batch have been mapped. Every write goes through the job
store's compare-and-set, and a run records which provider result it already counted, so a
redelivered task neither finishes an item twice nor counts an attempt twice; and one run of
each submission or poll goes on at a time (:func:`_leased`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from celery import shared_task

from worker import metrics
from worker.adapters.rate_budget import BatchQueueFull
from worker.constants import (
    BATCH_ITEMS_KEY,
    BATCH_QUEUE,
    ECONOMY_CANCEL_TASK,
    ECONOMY_POLL_TASK,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RESEND_CLAIM,
    ECONOMY_RUNS_KEY,
    ECONOMY_SENDING_MARK,
    ECONOMY_STATE_KEY,
    ECONOMY_SUBMIT_TASK,
)
from worker.contract import ErrorInfo, JobStatus
from worker.core.pipeline import (
    Prepared,
    RerankRun,
    SearchPipeline,
    dump_prepared,
    load_prepared,
)
from worker.core.types import TokenUsage
from worker.errors import AttemptOutcome, RerankAttemptError, RerankFailed, SiftError
from worker.logcontext import job_context
from worker.queue import liveness
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.jobstore import BatchJob, ItemTransition, JobStore

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches, BatchLine

log = logging.getLogger(__name__)

T = TypeVar("T")
PAGE = 500  # items read from Redis, or results mapped, at a time
SUBMIT_CLAIM = "submit"
# Past the economy deadline plus the provider's own 24 h, a poll that still cannot reach the
# provider gives up and applies the failure policy to what is left.
PROVIDER_EXPIRY_SECONDS = 24 * 3600.0
_ENVELOPE = len('{"requests":[]}')
SUBMISSION_CHARS = 12
# A create whose answer was lost (a timeout, a cut connection, the worker killed) may have
# made a provider batch: it is looked for among those created from this long before the call
# to this long after the last piece of its body went out (the provider's own time to make
# it, and the clocks' skew).
DOUBT_WINDOW_SECONDS = 120.0
DOUBT = "doubt:"  # a run's provider while its create is in doubt: "doubt:<submission>"
# Each submission and poll says by when it should run next (its countdown plus this margin:
# a worker's death and restore, a long mapping between its marks). One not run by then lost
# its message (the broker's pop-then-record window; a retry not published during a Redis
# outage): the re-drive's sweep sends it again (:func:`rewake`).
WATCH_MARGIN_SECONDS = 300.0


def custom_id(position: int, submission: str) -> str:
    """The ``custom_id`` of the item at ``position`` in the provider batch a submission
    creates (``^[a-zA-Z0-9_-]{1,64}$``): ``i<position>-<submission>``. The submission part
    tells a result of this create from one of any other provider batch."""
    return f"i{position}-{submission}"


def position_of(value: str) -> int | None:
    """The position a ``custom_id`` names, or None for one Sift did not write."""
    head = value.split("-", 1)[0]
    if not head.startswith("i") or not head[1:].isdigit():
        return None
    return int(head[1:])


def submission_of(value: str) -> str | None:
    """The submission a ``custom_id`` names (None: none)."""
    _, dash, tail = value.partition("-")
    return tail if dash and tail else None


def new_submission() -> str:
    """A fresh submission token: each create's own, written before the call is made."""
    return uuid.uuid4().hex[:SUBMISSION_CHARS]


def chunk_requests(
    requests: Iterable[T], size: Callable[[T], int], *, max_requests: int, max_bytes: int
) -> Iterator[list[T]]:
    """Group requests into provider batches: at most ``max_requests`` each, and a body
    (``{"requests":[r1,r2,...]}``, ``size(r)`` bytes per request) of at most ``max_bytes``.

    >>> [len(c) for c in chunk_requests(["ab"] * 5, len, max_requests=2, max_bytes=100)]
    [2, 2, 1]
    """
    chunk: list[T] = []
    used = _ENVELOPE
    for request in requests:
        n = size(request)
        if chunk and (len(chunk) >= max_requests or used + 1 + n > max_bytes):
            yield chunk
            chunk, used = [], _ENVELOPE
        used += n + (1 if chunk else 0)
        chunk.append(request)
    if chunk:
        yield chunk


# --- a run's record: what the provider did for one item, across rounds ----------------------


def _new_run(position: int) -> dict[str, Any]:
    return {
        "pos": position,
        "provider": None,  # the provider batch the item is in now
        "submission": None,  # the token of the create that put it there
        "pending": None,  # a create under way: {"submission", "at", "requests"}
        "handled": None,  # the provider batch whose result was counted last
        "round": 0,
        "resubmit": False,
        "first_submitted_at": None,
        "submitted_at": None,
        "attempts": [],
        "usage": [0, 0, 0, 0],
        "cost_usd": 0.0,
        "last_error": None,
    }


def _rerank_run(record: dict[str, Any]) -> RerankRun:
    return RerankRun(
        attempts=list(record["attempts"]),
        usage=TokenUsage(*record["usage"]),
        cost_usd=None if record["cost_usd"] is None else float(record["cost_usd"]),
    )


def _store_run(record: dict[str, Any], run: RerankRun) -> None:
    record["attempts"] = run.attempts
    record["usage"] = run.usage.counts()
    record["cost_usd"] = run.cost_usd


# --- the lane's context ----------------------------------------------------------------------


def economy_pipeline(task: SiftTask) -> SearchPipeline:
    """The runtime's pipeline at the Message Batches price, labelled ``lane="economy"``."""
    pipeline = getattr(task.context.runtime, "economy", None)
    if not isinstance(pipeline, SearchPipeline):
        raise SiftError("this worker's runtime has no economy pipeline")
    return pipeline


def _batches(task: SiftTask) -> AnthropicMessageBatches:
    client = task.context.batches
    if client is None:
        raise RerankAttemptError(
            AttemptOutcome.HTTP_4XX, "the economy lane needs SIFT_GENERATION_MODEL"
        )
    return client


def is_prepared(store: JobStore, batch_id: str, query_id: str) -> bool:
    """Whether an item's first half ran already (a chunk delivered again need not, and must
    not, run it again: :func:`save_prepared`)."""
    return store.economy_get(batch_id, ECONOMY_PREPARED_KEY, [query_id])[0] is not None


def save_prepared(store: JobStore, batch_id: str, query_id: str, position: int,
                  prepared: Prepared) -> None:  # fmt: skip
    """Keep a prepared item's state until its provider result comes back. The first one kept
    stays: its prompt may have gone out already, and the model's answer is positions in the
    candidates it listed. A chunk run again (delivered again, re-driven) prepares anew, and
    the index may have changed meanwhile: its candidates in another order, or others."""
    data = dump_prepared(prepared)
    data["pos"] = position
    store.economy_save_new(
        batch_id, ECONOMY_PREPARED_KEY, query_id, json.dumps(data, separators=(",", ":"))
    )


def maybe_submit(task: SiftTask, batch_id: str) -> None:
    """Enqueue the submission once every item is final or prepared (one chunk wins)."""
    store = task.context.store
    if store.economy_settled(batch_id) and store.economy_claim(batch_id, SUBMIT_CLAIM):
        _send(task, batch_id, SUBMIT_CLAIM, 0.0)
        log.info("batch %s: every item prepared; submission enqueued", batch_id)


def _send(task: SiftTask, batch_id: str, what: str, countdown: float) -> None:
    """Send the economy task for ``what`` (a provider batch's poll, or the submission) as a
    new message, which supersedes any other of that task still on its way (:func:`_taken`)."""
    task_id = f"eco-{uuid.uuid4().hex}"
    task.context.store.economy_hand_over(batch_id, what, task_id)
    _expect(task, batch_id, what, countdown)
    _give_back(task, batch_id, what)
    name, args = _task_of(batch_id, what)
    task.app.send_task(name, args=args, queue=BATCH_QUEUE, task_id=task_id,
                       countdown=countdown or None)  # fmt: skip


def _task_of(batch_id: str, what: str) -> tuple[str, list[Any]]:
    if what == SUBMIT_CLAIM:
        return ECONOMY_SUBMIT_TASK, [batch_id]
    return ECONOMY_POLL_TASK, [batch_id, what]


def _taken(task: SiftTask, batch_id: str, what: str) -> bool:
    """Whether this message is the one to run the economy task for ``what``. A message sent
    again by :func:`rewake`, or a poll sent again for a provider batch found recorded,
    supersedes the one before it, which may yet come (late, not lost: held by a worker
    killed during a long outage, behind a backlog of the batch queue): that one stops here,
    or two polls would each go on retrying and each map the results (a failed item
    resubmitted twice, paid twice), two submissions each create the same items' batches.
    A retry keeps its task id, so the chain it continues stays the one."""
    if task.context.store.economy_take(batch_id, what, str(task.request.id)):
        return True
    log.info("batch %s: its %s task was sent again since this message; it stops", batch_id, what)
    return False


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
    (:func:`_leased`), takes it over. A run stuck past its watch's margin since its last
    mark is let go (its lease lapses, as a lease with no keeper did). A fork (a prefork
    child) starts a keeper of its own: threads do not survive it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # lease -> when its run last marked, its store, how long it lives unrenewed
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
            self.held[lease] = (time.time(), task.context.store, _lease_seconds(task))

    def drop(self, lease: tuple[str, str, str]) -> None:
        with self.lock:
            self.held.pop(lease, None)

    def _run(self, every: float) -> None:
        while True:
            time.sleep(every)
            with self.lock:
                leases = list(self.held.items())
            for lease, (marked, store, seconds) in leases:
                batch_id, what, holder = lease
                try:
                    kept = time.time() - marked < WATCH_MARGIN_SECONDS and store.economy_lease(
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


def _leased(task: SiftTask, batch_id: str, what: str, run: Callable[[], None]) -> None:
    """Run the economy task for ``what`` as the one run of it under way. Two runs of one task
    can overlap: the same message delivered again while its run goes on (kombu restores it
    once the visibility timeout passes), or the watch's re-send of a run whose create or
    results page took longer than its margin. Each would map the same results and resubmit
    the same items, or settle the other's create as in doubt and make the items' provider
    batch again. So a run holds a lease (its worker id and a token), kept alive while its
    process lives (:class:`_Keeper`): a second run finding it held by a live worker waits
    for it as long as a lease lives unrenewed (a holder that died lets it lapse by then),
    then stands down; and the holder's own marks (each create, each piece of a create's
    body, each results page: :func:`_expect`) renew it, so a holder whose lease was taken
    over (its worker judged dead: its heartbeat gone, or its process stalled) stands down at
    its next mark, even if the lease is free again by then. The run under way
    keeps the task's watch, which sends it again should it die with nothing else to follow."""
    store = task.context.store
    beat = liveness.current()
    holder = f"{beat.worker_id if beat else ''} {uuid.uuid4().hex}"
    seconds = _lease_seconds(task)
    every = float(task.context.settings.worker_heartbeat_seconds)
    give_up = time.monotonic() + seconds + every
    while not store.economy_lease(batch_id, what, holder, seconds):
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
        log.warning("batch %s: another run took its %s task over; this one stopped",
                    batch_id, what)  # fmt: skip
    finally:
        _RUN.lease = None
        _KEEPER.drop(lease)
        store.economy_unlease(batch_id, what, holder)


def _expect(
    task: SiftTask, batch_id: str, what: str, countdown: float, *, sending: str | None = None
) -> None:
    """The economy task for ``what`` (a provider batch, or the submission) runs again within
    ``countdown`` seconds, or its message was lost (:func:`rewake`). A mark of the run under
    way (``countdown`` 0) also renews its lease, or stops it if another run took it over; a
    later one (its retry's, or a new message's, countdown) gives the lease back.
    ``sending``: the mark is the guard of a piece of that submission's create body
    (:func:`_sending`), and the time is kept with the lease, under the same check."""
    store = task.context.store
    lease: tuple[str, str, str] | None = getattr(_RUN, "lease", None)
    holder = lease[2] if lease is not None and lease[:2] == (batch_id, what) else None
    renew = countdown == 0.0 and holder is not None
    mark = None if sending is None else (ECONOMY_SENDING_MARK + sending, repr(time.time()))
    if renew and not store.economy_lease(
        batch_id, what, str(holder), _lease_seconds(task), renew=True, resume=True, mark=mark
    ):
        raise _StoodDown(what)
    if renew and lease is not None:
        _KEEPER.keep(task, lease)  # marked: not stuck
    if mark is not None and not renew:
        store.economy_save(batch_id, ECONOMY_STATE_KEY, {mark[0]: mark[1]})
    store.economy_expect(batch_id, what, time.time() + countdown + WATCH_MARGIN_SECONDS)
    if countdown > 0.0:
        _give_back(task, batch_id, what)


def _sending(task: SiftTask, batch_id: str, what: str, submission: str) -> Callable[[], None]:
    """The guard of a create's upload, run before each piece of its body goes out
    (:meth:`AnthropicMessageBatches.create`'s ``before_write``). The run's lease is renewed,
    or the upload stops short of its end (taken over: the new run may send the same requests
    again, and this create, completed after all, would be a second provider batch, paid
    twice); and the time is marked, in the same step, as the latest at which this create's
    body could have been completed: :func:`settle_doubts` waits the doubt window past it,
    and looks for its batch up to then, not only the window past the create's start."""
    return lambda: _expect(task, batch_id, what, 0.0, sending=submission)


def _give_back(task: SiftTask, batch_id: str, what: str) -> None:
    """This run hands the task for ``what`` over to its next message (a retry, or one sent
    anew): its lease is given back before that message is published, or the message might
    come first and stand down."""
    lease: tuple[str, str, str] | None = getattr(_RUN, "lease", None)
    if lease is not None and lease[:2] == (batch_id, what):
        _KEEPER.drop(lease)
        task.context.store.economy_unlease(batch_id, what, lease[2])
        _RUN.lease = None


def rewake(store: JobStore, send: Callable[[str, list[Any], str, str], None], now: float) -> int:
    """Send again every economy task that should have run by ``now`` and did not: its message
    was lost, and nothing else would bring it back (the economy lane's batches wait for hours
    by design, so the re-drive's stall test does not apply to them). A batch finished or gone
    needs none. Answers how many were sent. ``send`` is the re-drive's
    ``(task name, args, queue, task id)``."""
    sent = 0
    for batch_id, what in store.economy_overdue(now):
        batch = store.get_batch(batch_id)
        if batch is None or batch.finished_at is not None:
            store.economy_met(batch_id, what)
            continue
        name, args = _task_of(batch_id, what)
        task_id = f"rewake-{uuid.uuid4().hex}"
        store.economy_hand_over(batch_id, what, task_id)  # the late one, if it comes, stops
        store.economy_expect(batch_id, what, now + WATCH_MARGIN_SECONDS)
        send(name, args, BATCH_QUEUE, task_id)
        metrics.redriven("economy")  # a lost message, as the re-drive's others are counted
        log.warning("batch %s: its %s task did not run when due; sent again", batch_id, what)
        sent += 1
    return sent


def _item_done(task: SiftTask, batch: BatchJob, transition: ItemTransition) -> None:
    if transition.batch_completed:
        store = task.context.store
        store.economy_delete(batch.id)
        done = store.get_batch(batch.id)
        log.info("batch %s: completed", batch.id)
        status = done.status.value if done else JobStatus.SUCCEEDED.value
        metrics.job_completed("batch", status)  # once: only one transition completes it
        task.announce_batch(batch, status)


def _cancel(
    task: SiftTask, batch: BatchJob, query_id: str, record: dict[str, Any] | None = None
) -> None:
    """Cancel one item. ``record`` is its run (None: read here): what its earlier rounds
    were billed goes on the canceled item's record, as the counters counted it."""
    store = task.context.store
    if record is None:
        raw = store.economy_get(batch.id, ECONOMY_RUNS_KEY, [query_id])[0]
        record = json.loads(raw) if raw else None
    usage = _rerank_run(record).job_usage() if record and record["attempts"] else None
    transition = store.cancel_item(batch.id, query_id, usage=usage)
    if transition.applied:
        metrics.job_completed("batch_item", "canceled")
    _item_done(task, batch, transition)


def _finish(
    task: SiftTask, batch: BatchJob, query_id: str, prepared: Prepared, run: RerankRun
) -> None:
    """The pipeline's second half for one item, and its final status."""
    pipeline = economy_pipeline(task)
    error: ErrorInfo | None = None
    try:
        result = pipeline.finish(prepared, run)
    except RerankFailed as exc:
        error, result = error_info(exc), None
    transition = task.context.store.finish_item(batch.id, query_id, result=result, error=error)
    count_completed("batch_item", transition.applied, error)
    _item_done(task, batch, transition)


# --- submission -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    query_id: str
    request: dict[str, Any]
    size: int
    run: dict[str, Any]


def _pending(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], expected: str | None
) -> Iterator[_Pending]:
    """The items to send now: running, and in provider batch ``expected`` (None: never sent).
    Their ``custom_id`` is set when their provider batch is made up (:func:`submit`)."""
    from worker.adapters.anthropic_batches import encode_body  # the adapter is the worker's

    pipeline, client = economy_pipeline(task), _batches(task)
    for qid, data, run in _running(task, batch, query_ids):
        if run["provider"] != expected or run.get("pending"):
            continue  # sent already (a redelivered task), or its create is in doubt
        item = load_prepared(pipeline, data)
        assert item.prompt is not None
        request = {
            "custom_id": custom_id(run["pos"], "x" * SUBMISSION_CHARS),  # its size, for now
            "params": client.request_params(item.prompt),
        }
        size = len(encode_body(request))  # its bytes in the create's body
        yield _Pending(qid, request, size, run)


def _running(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str]
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The items among ``query_ids`` still running, with their prepared state and run record,
    read a page at a time."""
    store = task.context.store
    for start in range(0, len(query_ids), PAGE):
        page = list(query_ids[start : start + PAGE])
        statuses = store.economy_get(batch.id, BATCH_ITEMS_KEY, page)
        prepared = store.economy_get(batch.id, ECONOMY_PREPARED_KEY, page)
        runs = store.economy_get(batch.id, ECONOMY_RUNS_KEY, page)
        for qid, status, raw, raw_run in zip(page, statuses, prepared, runs, strict=True):
            if status != JobStatus.RUNNING.value or raw is None:
                continue
            data = json.loads(raw)
            yield qid, data, json.loads(raw_run) if raw_run else _new_run(int(data["pos"]))


def _save_runs(task: SiftTask, batch: BatchJob, runs: Iterable[tuple[str, dict[str, Any]]]) -> None:
    task.context.store.economy_save(
        batch.id,
        ECONOMY_RUNS_KEY,
        {qid: json.dumps(run, separators=(",", ":")) for qid, run in runs},
    )


def _may_have_created(error: RerankAttemptError) -> bool:
    """False when the create surely made nothing: refused (4xx, 429) or never sent (the
    rate budget, the processing queue's cap). A timeout, a cut connection or a 5xx may have
    come after the provider made the batch."""
    return error.outcome not in (
        AttemptOutcome.HTTP_4XX,
        AttemptOutcome.RATE_LIMITED,
        AttemptOutcome.BUDGET_EXHAUSTED,
    )


def _record_provider(
    task: SiftTask, batch: BatchJob, provider_id: str, record: dict[str, Any]
) -> None:
    """Keep a provider batch on the batch's record and start polling it."""
    store = task.context.store
    store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps(record)})
    _send_poll(task, batch, provider_id)


def _send_poll(task: SiftTask, batch: BatchJob, provider_id: str) -> None:
    _send(task, batch.id, provider_id, task.context.settings.economy_poll_seconds)


def settle_doubts(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], expected: str | None
) -> None:
    """Find the provider batches of creates whose answer never came (a timeout, a cut
    connection, a worker killed between the call and its record), before anything is sent
    again: the Message Batches API has no idempotency key, so a second create would be a
    second provider batch, paid twice.

    A create in doubt left ``pending`` on its items' runs: its submission token, when it was
    made and how many requests it held, and ``answered`` once its call came back (failed).
    The workspace's provider batches created from :data:`DOUBT_WINDOW_SECONDS` before it to
    that long past the last piece of its body (marked as it went out: :func:`_sending`; a
    large body on a slow link outlasts the window), with as many requests, that this batch
    does not know yet are its candidates. None: the create made nothing, and its items are
    sent now; but a create whose call never came back may still be under way in a run
    judged dead (stalled) or slow, until the window's end past that last piece: till then
    the settling is tried again later (a retryable error). A run taken over sends no piece
    more (its guard finds its lease gone), so its batch, if the provider makes it, was made
    by then.
    Otherwise every candidate is polled (never canceled: it may be another client's), its
    items wait as ``doubt:<submission>``, and the results tell: lines whose ``custom_id``
    carries the submission prove the candidate ours (:func:`map_results`); when every
    candidate ended without one, the items are sent again."""
    doubts: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for qid, _, run in _running(task, batch, query_ids):
        pending = run.get("pending")
        if pending and run["provider"] == expected:
            doubts.setdefault(pending["submission"], []).append((qid, run))
    if not doubts:
        return
    client, store = _batches(task), task.context.store
    known = {
        provider_id: json.loads(raw)
        for provider_id, raw in store.economy_all(batch.id, ECONOMY_PROVIDERS_KEY).items()
    }
    marks = store.economy_get(
        batch.id, ECONOMY_STATE_KEY, [ECONOMY_SENDING_MARK + s for s in doubts]
    )
    for (submission, items), mark in zip(doubts.items(), marks, strict=True):
        pending = items[0][1]["pending"]
        at, requests = float(pending["at"]), int(pending["requests"])
        # the last piece of its body went out by then, or never will (its run, taken over,
        # stops its upload short): a create whose upload lasted past the window is covered
        last = max(at, float(mark)) if mark else at
        mine = [pid for pid, r in known.items() if r.get("submission") == submission]
        recorded = [pid for pid in mine if not known[pid].get("doubt")]
        if recorded:  # its answer came and was kept: the runs just never said so
            for _, run in items:
                run.update(provider=recorded[0], submission=submission, pending=None,
                           round=run["round"] + 1, resubmit=False, submitted_at=at,
                           first_submitted_at=run["first_submitted_at"] or at)  # fmt: skip
            _save_runs(task, batch, items)
            _send_poll(task, batch, recorded[0])  # its poll may not have been sent
            continue
        # candidates kept already: a settling killed before the runs said so; else looked for
        found = mine or [
            b.id
            for b in client.created_between(at - DOUBT_WINDOW_SECONDS, last + DOUBT_WINDOW_SECONDS)
            if b.requests == requests and b.id not in known
        ]
        wait = last + DOUBT_WINDOW_SECONDS - time.time()
        if not found and not pending.get("answered") and wait > 0:
            # No answer came to its run, which may not be dead but stalled (its lease taken
            # over) or slow, its create still under way: the provider may make the batch yet,
            # as late as the window's end. Sent again now, the items would be paid twice.
            raise RerankAttemptError(
                AttemptOutcome.CONNECTION,
                f"create {submission} of {requests} requests may still be under way",
                retry_after=wait,
            )
        round_ = max(run["round"] for _, run in items) + 1
        # the candidates first, each watched: killed before the runs are saved, the items are
        # still pending and the next settling finds them here; killed after, before a poll
        # went, the watch sends it. Never the runs first: items waiting on candidates that
        # no record names, and no poll, would wait forever.
        for provider_id in found:
            if provider_id not in known:
                record = {"round": round_, "requests": requests, "created_at": at,
                          "ended_at": None, "submission": submission, "doubt": True}  # fmt: skip
                store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY,
                                   {provider_id: json.dumps(record)})  # fmt: skip
            _expect(task, batch.id, provider_id, task.context.settings.economy_poll_seconds)
        for _, run in items:
            run["pending"] = None
            if found:
                run.update(
                    provider=DOUBT + submission,
                    submission=submission,
                    round=run["round"] + 1,
                    resubmit=False,
                    submitted_at=at,
                    first_submitted_at=run["first_submitted_at"] or at,
                )
        _save_runs(task, batch, items)
        for provider_id in found:
            _send_poll(task, batch, provider_id)
        log.warning(
            "batch %s: a create of %d requests got no answer; %s",
            batch.id,
            requests,
            f"polling its candidates {found}" if found else "it made no provider batch",
        )


def submit(
    task: SiftTask,
    batch: BatchJob,
    query_ids: Sequence[str],
    *,
    expected: str | None = None,
    watch: str = SUBMIT_CLAIM,
) -> list[str]:
    """Send these items' prompts as provider batches; answers the provider batch ids.

    Each create is written down before it is made (its items' ``pending``), so that one whose
    answer is lost is looked for before anything is sent again (:func:`settle_doubts`).
    ``watch`` is the task sending them (the submission, or a provider batch's poll): each
    create tells the watch it is alive, so that a long submission is not sent again while
    it runs (a second one would create the same items' batches again)."""
    settings = task.context.settings
    if batch.canceled_at is not None:
        for qid in query_ids:
            _cancel(task, batch, qid)
        return []
    client = _batches(task)
    # still this run's to do (a run whose lease was taken over stops before it settles or
    # sends anything: the new holder does; after a results page this is the mapping's mark)
    _expect(task, batch.id, watch, 0.0)
    settle_doubts(task, batch, query_ids, expected)
    created: list[str] = []
    chunks = chunk_requests(
        _pending(task, batch, query_ids, expected),
        lambda p: p.size,
        max_requests=settings.economy_max_requests_per_batch,
        max_bytes=settings.economy_max_batch_bytes,
    )
    for chunk in chunks:
        _expect(task, batch.id, watch, 0.0)
        submission = new_submission()
        started = time.time()
        for p in chunk:
            p.request["custom_id"] = custom_id(p.run["pos"], submission)
            p.run["pending"] = {"submission": submission, "at": started, "requests": len(chunk)}
        _save_runs(task, batch, ((p.query_id, p.run) for p in chunk))
        try:
            guard = _sending(task, batch.id, watch, submission)
            provider = client.create([p.request for p in chunk], before_write=guard)
        except RerankAttemptError as exc:
            # a run stalled past its lease (taken over meanwhile) writes nothing more: the
            # items' runs may be the new holder's by now (sent again once the window passed)
            _expect(task, batch.id, watch, 0.0)
            for p in chunk:
                if _may_have_created(exc):  # its call is over: settled at once, not waited for
                    p.run["pending"]["answered"] = True
                else:
                    p.run["pending"] = None
            _save_runs(task, batch, ((p.query_id, p.run) for p in chunk))
            raise
        now = time.time()
        round_ = max(p.run["round"] for p in chunk) + 1
        # the provider batch first: killed before the runs say so, the items are still
        # pending, and settle_doubts finds it here by its submission
        record = {"round": round_, "requests": len(chunk), "created_at": now,
                  "ended_at": None, "submission": submission}  # fmt: skip
        _record_provider(task, batch, provider.id, record)
        for p in chunk:
            p.run.update(
                provider=provider.id,
                submission=submission,
                pending=None,
                round=p.run["round"] + 1,
                resubmit=False,
                submitted_at=now,
                first_submitted_at=p.run["first_submitted_at"] or now,
            )
        _save_runs(task, batch, ((p.query_id, p.run) for p in chunk))
        created.append(provider.id)
        log.info(
            "batch %s: provider batch %s with %d requests (round %d)",
            batch.id,
            provider.id,
            len(chunk),
            round_,
        )
    again = task.context.store.get_batch(batch.id)
    if created and again is not None and again.canceled_at is not None:
        for provider_id in created:  # canceled while we were sending: cancel what we sent
            _cancel_quietly(client, provider_id)
    return created


def _cancel_quietly(client: AnthropicMessageBatches, provider_id: str) -> None:
    try:
        client.cancel(provider_id)
    except RerankAttemptError as exc:
        log.warning("provider batch %s: cancel failed (%s); the poll will retry", provider_id, exc)


def _fail_items(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], failure: RerankAttemptError
) -> None:
    """Apply the failure policy to running items that could not be sent or polled."""
    pipeline = economy_pipeline(task)
    for qid, data, record in _running(task, batch, query_ids):
        run = _rerank_run(record)
        pipeline.record_attempt(run, failure.outcome, None, 0.0, provider_error=True)
        run.failure = failure
        _finish(task, batch, qid, load_prepared(pipeline, data), run)


def _unsent(task: SiftTask, batch: BatchJob, query_ids: Sequence[str]) -> list[str]:
    """The items among ``query_ids`` still running and in no provider batch yet."""
    return [qid for qid, _, run in _running(task, batch, query_ids) if run["provider"] is None]


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_SUBMIT_TASK, base=SiftTask, bind=True, max_retries=None
)
def economy_submit(self: SiftTask, batch_id: str) -> None:
    """Send a batch's prepared prompts as Message Batches (:func:`_submit`), as the one run
    of the submission under way (:func:`_leased`)."""
    _leased(self, batch_id, SUBMIT_CLAIM, lambda: _submit(self, batch_id))


def _submit(self: SiftTask, batch_id: str) -> None:
    """Send a batch's prepared prompts as Message Batches.

    A transient failure (429, 5xx, 529, a timeout) is retried at the poll's cadence for as
    long as the economy deadline lasts, not within the task retry budget: a provider outage
    of a minute must not fail a batch that may take 24 hours. A permanent one fails only the
    items not sent yet: those already in a provider batch wait for its results."""
    store, settings = self.context.store, self.context.settings
    batch = store.get_batch(batch_id)
    if batch is None:
        store.economy_met(batch_id, SUBMIT_CLAIM)
        return
    if not _taken(self, batch_id, SUBMIT_CLAIM):
        return
    _expect(self, batch_id, SUBMIT_CLAIM, 0.0)
    query_ids = store.economy_fields(batch_id, ECONOMY_PREPARED_KEY)
    try:
        submit(self, batch, query_ids)
        store.economy_met(batch_id, SUBMIT_CLAIM)
    except BatchQueueFull as exc:
        # not a failure: the provider's queue frees as its batches end. Sent again, the task
        # keeps its retry budget; what was sent already is not sent twice (``_pending``).
        log.info("batch %s: %s; submitting the rest later", batch_id, exc)
        _send(self, batch_id, SUBMIT_CLAIM, exc.retry_after or 0.0)
    except RerankAttemptError as exc:
        deadline = batch.created_at + settings.economy_deadline_seconds
        if exc.retryable and time.time() < deadline:
            log.warning("batch %s: submission failed, retrying: %s", batch_id, exc)
            # not before the rate budget or a 429's retry-after frees it
            countdown = max(_poll_countdown(self), exc.retry_after or 0.0)
            _expect(self, batch_id, SUBMIT_CLAIM, countdown)
            raise self.retry(exc=exc, countdown=countdown) from exc
        log.error("batch %s: submission failed for good: %s", batch_id, exc)
        _fail_items(self, batch, _unsent(self, batch, query_ids), exc)
        store.economy_met(batch_id, SUBMIT_CLAIM)


# --- polling and mapping the results --------------------------------------------------------


def _poll_countdown(task: SiftTask) -> float:
    settings = task.context.settings
    return float(
        min(
            settings.economy_poll_max_seconds,
            settings.economy_poll_seconds * 2 ** min(task.request.retries, 30),
        )
    )


def _provider_record(store: JobStore, batch_id: str, provider_id: str) -> dict[str, Any]:
    raw = store.economy_get(batch_id, ECONOMY_PROVIDERS_KEY, [provider_id])[0]
    record: dict[str, Any] = json.loads(raw) if raw else {}
    return record


def _is_current(run: dict[str, Any], provider_id: str, submission: str | None) -> bool:
    """Whether a result of ``provider_id`` whose ``custom_id`` names ``submission`` is the
    answer the item waits for: its create's (the one recorded, or one still in doubt)."""
    if submission is None:  # a custom_id of before submissions were named
        return bool(run["provider"] == provider_id)
    pending = run.get("pending") or {}
    return submission in (run.get("submission"), pending.get("submission"))


def _waits_on(run: dict[str, Any], provider_id: str, submission: str | None) -> bool:
    """Whether an item waits on this provider batch (or on the create it answers)."""
    return run["provider"] == provider_id or (
        submission is not None and run["provider"] == DOUBT + submission
    )


def _items_waiting(
    store: JobStore, batch_id: str, provider_id: str, submission: str | None
) -> list[str]:
    return [
        qid
        for qid, raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).items()
        if _waits_on(json.loads(raw), provider_id, submission)
    ]


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_POLL_TASK, base=SiftTask, bind=True, max_retries=None
)
def economy_poll(self: SiftTask, batch_id: str, provider_id: str) -> None:
    """Poll one provider batch until it ended, then map its results to the batch's items
    (:func:`_poll`), as the one run of that poll under way (:func:`_leased`)."""
    _leased(self, batch_id, provider_id, lambda: _poll(self, batch_id, provider_id))


def _poll(self: SiftTask, batch_id: str, provider_id: str) -> None:
    """Poll one provider batch until it ended, then map its results to the batch's items."""
    store, settings = self.context.store, self.context.settings
    batch = store.get_batch(batch_id)
    if batch is None or batch.finished_at is not None:
        store.economy_met(batch_id, provider_id)
    if batch is None or not _taken(self, batch_id, provider_id):
        return
    if batch.finished_at is not None:
        if self.delivery() > 1:
            # a redelivered poll of a finished batch: the worker whose mapping completed it
            # may have died before enqueueing its webhook: sent again (the same webhook-id)
            log.info("batch %s: completed (webhook sent again)", batch_id)
            self.announce_batch(batch, batch.status.value)
        # every item is final: nothing the provider batch holds would count. Polled on, a
        # provider batch Sift may not cancel (a candidate of a create in doubt, maybe
        # another client's) would be retrieved every 10 minutes for up to 24 hours.
        return
    client = _batches(self)
    record = _provider_record(store, batch_id, provider_id)
    _expect(self, batch_id, provider_id, 0.0)
    try:
        status = client.retrieve(provider_id)
        if not status.ended:
            # a candidate of a create in doubt may be another client's: never canceled
            ours = not record.get("doubt")
            if batch.canceled_at is not None and status.processing_status == "in_progress" and ours:
                # a refused cancel (the batch ended meanwhile, say) is no failure of its
                # items: the next poll sees it ended, or asks again
                _cancel_quietly(client, provider_id)
            _expect(self, batch_id, provider_id, _poll_countdown(self))
            raise self.retry(countdown=_poll_countdown(self))
        map_results(self, batch, provider_id)
        store.economy_met(batch_id, provider_id)
    except RerankAttemptError as exc:
        give_up = batch.created_at + settings.economy_deadline_seconds + PROVIDER_EXPIRY_SECONDS
        if exc.retryable and time.time() < give_up:
            log.warning("provider batch %s: %s; polling again", provider_id, exc)
            _expect(self, batch_id, provider_id, _poll_countdown(self))
            raise self.retry(countdown=_poll_countdown(self)) from exc
        log.error("provider batch %s: giving up: %s", provider_id, exc)
        store.economy_met(batch_id, provider_id)
        if record.get("doubt"):  # not shown to be ours: as if it were another client's
            _resend_after_candidate(self, batch, provider_id, give_up)
            return
        mine = _items_waiting(store, batch_id, provider_id, record.get("submission"))
        _fail_items(self, batch, mine, exc)


def _resend_after_candidate(
    task: SiftTask, batch: BatchJob, provider_id: str, give_up: float
) -> None:
    """A candidate that cannot be polled any more is judged not Sift's (:func:`_candidate_ended`).
    Should that resend of its items fail, it is retried as any failed create is (this poll
    again: the candidate is kept as ended, so only the resend is), else the items take their
    failure policy. The error never escapes the task: its watch is met by then, so nothing
    would run it again, and the items would wait forever."""
    try:
        _candidate_ended(task, batch, provider_id, proven=False)
    except RerankAttemptError as exc:
        if exc.retryable and time.time() < give_up:
            log.warning("batch %s: resending after candidate %s failed, retrying: %s",
                        batch.id, provider_id, exc)  # fmt: skip
            _expect(task, batch.id, provider_id, _poll_countdown(task))
            raise task.retry(countdown=_poll_countdown(task)) from exc
        submission = _provider_record(task.context.store, batch.id, provider_id).get("submission")
        waiting = _items_waiting(task.context.store, batch.id, DOUBT + str(submission), None)
        _fail_items(task, batch, waiting, exc)


def _candidate_ended(task: SiftTask, batch: BatchJob, provider_id: str, *, proven: bool) -> None:
    """A candidate of a create in doubt ended: kept as such, and if every candidate of that
    create ended without a line of it, the create made nothing: its items are sent again."""
    store = task.context.store
    record = _provider_record(store, batch.id, provider_id)
    record.update(ended_at=record.get("ended_at") or time.time(), proven=proven)
    store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps(record)})
    submission = record.get("submission")
    if proven or submission is None:
        return
    group = [
        json.loads(raw)
        for raw in store.economy_all(batch.id, ECONOMY_PROVIDERS_KEY).values()
        if json.loads(raw).get("submission") == submission
    ]
    if any(r.get("proven") or r.get("ended_at") is None for r in group):
        return  # ours, or one still running may be
    # Two candidates' polls that map their results at the same instant both find every
    # candidate ended, and both read the items waiting before either sends them: each would
    # send them, two provider batches paid. One poll claims the resend (its own retries and
    # redeliveries keep it: a resend that failed, or died, is done by that poll again).
    if not store.economy_claim_for(batch.id, ECONOMY_RESEND_CLAIM + submission, provider_id):
        log.info("batch %s: create %s's requests are sent again by another candidate's poll",
                 batch.id, submission)  # fmt: skip
        return
    waiting = _items_waiting(store, batch.id, DOUBT + submission, None)
    if waiting:
        log.warning("batch %s: no provider batch was made by create %s; sending its %d "
                    "requests again", batch.id, submission, len(waiting))  # fmt: skip
        submit(task, store.get_batch(batch.id) or batch, waiting, expected=DOUBT + submission,
               watch=provider_id)  # fmt: skip


def map_results(task: SiftTask, batch: BatchJob, provider_id: str) -> None:
    """Stream an ended provider batch's results and map each line to its item."""
    client, store = _batches(task), task.context.store
    record = _provider_record(store, batch.id, provider_id)
    submission = record.get("submission")
    resubmit: list[str] = []
    page: list[BatchLine] = []
    lines = ours = 0
    seen: set[str] = set()
    for line in client.results(provider_id):
        if line.custom_id in seen:  # a request's result given twice: the first one counts
            log.warning("provider batch %s: %r again; ignored", provider_id, line.custom_id)
            continue
        if line.custom_id:
            seen.add(line.custom_id)
        page.append(line)
        lines += 1
        ours += submission is not None and submission_of(line.custom_id) == submission
        if len(page) >= PAGE:
            resubmit += _map_page(task, batch, provider_id, page)
            page = []
            _expect(task, batch.id, provider_id, 0.0)  # a long mapping is no lost message
    resubmit += _map_page(task, batch, provider_id, page)
    in_doubt = bool(record.get("doubt")) and not ours
    if not in_doubt:
        resubmit += _map_left_out(task, batch, provider_id, submission, set(resubmit))
    if resubmit:
        fresh = store.get_batch(batch.id) or batch
        # once each: a custom_id twice in one create is refused (400) for the whole batch
        submit(task, fresh, list(dict.fromkeys(resubmit)), expected=provider_id, watch=provider_id)
    if in_doubt:
        log.info("provider batch %s: not the create in doubt (no line of it)", provider_id)
        _candidate_ended(task, batch, provider_id, proven=False)
        return
    record = _provider_record(store, batch.id, provider_id)
    record.update(ended_at=time.time(), results=lines, resubmitted=len(resubmit))
    if record.get("doubt"):
        record["proven"] = True
    store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps(record)})
    log.info(
        "batch %s: provider batch %s mapped, %d results, %d resubmitted",
        batch.id,
        provider_id,
        lines,
        len(resubmit),
    )


def _map_left_out(
    task: SiftTask,
    batch: BatchJob,
    provider_id: str,
    submission: str | None,
    resubmitting: set[str],
) -> list[str]:
    """The requests an ended provider batch's results left out (no line, or one that named
    no request), each mapped as a ``malformed`` result of its item: resubmitted while its
    attempts and the deadline last, as the standard lane retries an unreadable answer, then
    the failure policy. They were failed at once, with two attempts of the three unused,
    so a batch's economy lane failed items its standard lane would have answered.

    Every item still waiting on the provider batch and not among ``resubmitting`` (the
    file's lines to resubmit) is one: a task run again after a kill maps it again, counting
    nothing twice (its run is ``handled``) and resubmitting it if it was to be."""
    from worker.adapters.anthropic_batches import BatchLine  # the adapter is the worker's

    waiting = _items_waiting(task.context.store, batch.id, provider_id, submission)
    left_out = [
        (qid, int(data["pos"]), run.get("submission") if submission is None else submission)
        for qid, data, run in _running(task, batch, waiting)
        if qid not in resubmitting
    ]
    if not left_out:
        return []
    log.warning("provider batch %s: %d requests had no result", provider_id, len(left_out))
    failure = RerankAttemptError(
        AttemptOutcome.MALFORMED, f"provider batch {provider_id} ended without its result"
    )
    lines = [
        BatchLine(custom_id(pos, sub) if sub else f"i{pos}", "malformed", error=failure)
        for _, pos, sub in left_out
    ]
    resubmit: list[str] = []
    for start in range(0, len(lines), PAGE):
        resubmit += _map_page(task, batch, provider_id, lines[start : start + PAGE])
    # an item the mapping did not take as current (none should be) fails, as all did before,
    # rather than wait forever
    taken = resubmitting | set(resubmit)
    stuck = [qid for qid, _, _ in _running(task, batch, waiting) if qid not in taken]
    if stuck:
        _fail_items(task, batch, stuck, failure)
    return resubmit


def _map_page(
    task: SiftTask, batch: BatchJob, provider_id: str, lines: Sequence[BatchLine]
) -> list[str]:
    """Map one page of result lines; answers the query ids to resubmit."""
    if not lines:
        return []
    store, pipeline, client = task.context.store, economy_pipeline(task), _batches(task)
    settings = task.context.settings
    positions = [position_of(line.custom_id) for line in lines]
    qids = store.query_ids_at(batch.id, [p if p is not None else -1 for p in positions])
    known = [
        (line, qid)
        for line, position, qid in zip(lines, positions, qids, strict=True)
        if position is not None and qid is not None
    ]
    for line, position in zip(lines, positions, strict=True):
        if position is None:
            log.warning("provider batch %s: unknown custom_id %r", provider_id, line.custom_id)
    ids = [qid for _, qid in known]
    statuses = store.economy_get(batch.id, BATCH_ITEMS_KEY, ids)
    prepared = store.economy_get(batch.id, ECONOMY_PREPARED_KEY, ids)
    runs = store.economy_get(batch.id, ECONOMY_RUNS_KEY, ids)
    now = time.time()
    deadline = batch.created_at + settings.economy_deadline_seconds
    mapped: list[_Mapped] = []
    for (line, qid), status, raw, raw_run in zip(known, statuses, prepared, runs, strict=True):
        if status != JobStatus.RUNNING.value or raw is None or raw_run is None:
            continue  # final already, or canceled
        record = json.loads(raw_run)
        submission = submission_of(line.custom_id)
        if not _is_current(record, provider_id, submission):
            continue  # a stale result (the item moved on), or another create's
        record.update(provider=provider_id, pending=None)
        record["submission"] = submission or record.get("submission")
        if line.kind == "canceled":
            with job_context(f"{batch.id}/{qid}"):
                _cancel(task, batch, qid, record)
            continue
        item = load_prepared(pipeline, json.loads(raw))
        if item.prompt is not None:  # the standard lane's check of an answer's length
            line = client.checked(line, item.prompt)
        one = _Mapped(qid, line, record, item, _rerank_run(record))
        one.run.seconds = now - float(record["first_submitted_at"] or now)
        one.failure = None if line.reply is not None else _line_failure(line, provider_id)
        if record["handled"] != provider_id:  # else counted by an earlier run of this task
            _add_attempt(pipeline, one, provider_id, now, deadline, batch.canceled_at is None)
        mapped.append(one)
    # The runs are saved before the metrics count their attempts: a task run again after a
    # kill between the two finds them ``handled`` and counts nothing twice.
    fresh = [one for one in mapped if one.counted is not None]
    _save_runs(task, batch, ((one.qid, one.record) for one in fresh))
    for one in fresh:
        assert one.counted is not None
        pipeline.count_attempt(*one.counted)
    resubmit: list[str] = []
    for one in mapped:
        if one.record["resubmit"]:
            resubmit.append(one.qid)
            continue
        if one.line.reply is not None:
            one.run.reply, one.run.returned = one.line.reply, one.line.reply.positions
        else:
            one.run.failure = one.failure
        with job_context(f"{batch.id}/{one.qid}"):
            _finish(task, batch, one.qid, one.item, one.run)
    return resubmit


@dataclass(slots=True)
class _Mapped:
    """One result line mapped to its item, between its run's save and its item's finish."""

    qid: str
    line: BatchLine
    record: dict[str, Any]
    item: Prepared
    run: RerankRun
    failure: RerankAttemptError | None = None
    counted: tuple[AttemptOutcome, TokenUsage | None, float | None] | None = None


def _line_failure(line: BatchLine, provider_id: str) -> RerankAttemptError:
    """The failure a result line without an answer stands for."""
    if line.kind == "expired":
        return RerankAttemptError(
            AttemptOutcome.TIMEOUT,
            f"the provider expired the request unprocessed (batch {provider_id})",
        )
    assert line.error is not None
    return line.error


def _add_attempt(
    pipeline: SearchPipeline, one: _Mapped, provider_id: str, now: float, deadline: float,
    live: bool,
) -> None:  # fmt: skip
    """Count a line's attempt in its item's run (not yet in the metrics: ``one.counted``
    says what to count once the run is saved), and decide whether it is resubmitted."""
    record, run, failure = one.record, one.run, one.failure
    waited = now - float(record["submitted_at"] or now)
    detail = {"provider_batch": provider_id, "provider_result": one.line.kind}
    usage: TokenUsage | None
    if one.line.reply is not None:
        outcome, usage = AttemptOutcome.OK, one.line.reply.usage
    else:
        assert failure is not None
        found = getattr(failure, "usage", None)
        outcome, usage = failure.outcome, found if isinstance(found, TokenUsage) else None
    cost = pipeline.add_attempt(run, outcome, usage, waited, **detail)
    one.counted = (outcome, usage, cost)
    again = (
        failure is not None
        and failure.retryable
        and len(run.attempts) < pipeline.config.max_requests
        and now < deadline
        and live
    )
    _store_run(record, run)
    record.update(handled=provider_id, resubmit=again)
    if failure is not None:
        record["last_error"] = failure.message


# --- cancel ---------------------------------------------------------------------------------


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_CANCEL_TASK, base=SiftTask, bind=True
)
def economy_cancel(self: SiftTask, batch_id: str) -> None:
    """Cancel a canceled Sift batch's provider batches that have not ended, and the items
    waiting on a create in doubt: its candidates are never canceled (each may be another
    client's), so no canceled line would end them; they would wait for every candidate to
    end, up to the provider's 24 hours. Should a candidate prove theirs, its lines find
    them final and count for nothing (its cost is the price of not canceling another's)."""
    store = self.context.store
    providers = store.economy_all(batch_id, ECONOMY_PROVIDERS_KEY)
    if not providers:
        return
    client = _batches(self)
    for provider_id, raw in providers.items():
        record = json.loads(raw)
        if record.get("ended_at") is None and not record.get("doubt"):  # never another's
            _cancel_quietly(client, provider_id)
            log.info("batch %s: provider batch %s canceled", batch_id, provider_id)
    batch = store.get_batch(batch_id)
    if batch is None:
        return
    for qid, raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).items():
        record = json.loads(raw)
        if str(record["provider"] or "").startswith(DOUBT):
            _cancel(self, batch, qid, record)
