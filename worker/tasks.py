"""Sift's Celery tasks: one search, one chunk of a batch, one ingest, one webhook delivery.

Every task takes JSON ids, is idempotent (the job store's compare-and-set makes a
redelivered task a no-op for anything already final), and inherits
:class:`SiftTask`, which times it, counts deliveries so a poison message is
failed instead of looping, and owns the retry decision: only errors marked
``retryable`` are retried, at most ``SIFT_TASK_MAX_RETRIES`` times, with
exponential backoff and jitter.
"""

from __future__ import annotations

import gc
import importlib
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from celery import Task, shared_task
from celery.exceptions import Reject, Retry

from worker import metrics
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    ECONOMY_PRICE_DISCOUNT,
    INGEST_TASK,
    LANE_ECONOMY,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_BATCH_COMPLETED,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.contract import DocumentIn, ErrorInfo, SearchResult, SearchSpec
from worker.errors import Canceled, SiftError
from worker.items import CancelMarks, Chunk, ItemQueue, RunOutcome
from worker.jobstore import BatchItem, ItemTransition, JobStore, webhook_event
from worker.logcontext import job_context
from worker.ratelimit import LimitedReranker, ProviderLimiter
from worker.settings import Settings, load_settings

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

log = logging.getLogger(__name__)

RETRY_BASE_SECONDS = 1.0
RETRY_CAP_SECONDS = 60.0
# A worker's job-store calls ride out a Redis restart this long rather than fail the job.
STORE_OUTAGE_SECONDS = 30.0
# Allocations between young-generation collections, once the runtime is built (Python's
# default is 700): with hundreds of searches in flight, collections cost ~8% of the CPU.
GC_YOUNG_THRESHOLD = 20_000


class Runtime(Protocol):
    """What the tasks need from :mod:`worker.runtime`."""

    def search(
        self, spec: SearchSpec, tenant: str, before_model: Callable[[], None] | None = None
    ) -> SearchResult:
        """``before_model`` runs just before the model call and may raise ``Canceled``."""
        ...

    def ingest(self, index: str, tenant: str, documents: list[DocumentIn]) -> int: ...


@dataclass
class WorkerContext:
    """What one worker process shares across its threads, built once on first use."""

    settings: Settings
    store: JobStore
    limiter: ProviderLimiter
    _runtime: Runtime | None = None
    _items: ItemQueue | None = None
    _marks: CancelMarks | None = None
    _batches: AnthropicMessageBatches | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def items(self) -> ItemQueue:
        """The batch items of the process's chunks, run by ``SIFT_BATCH_ITEM_CONCURRENCY``
        threads (:mod:`worker.items`)."""
        if self._items is None:
            with self._lock:
                if self._items is None:
                    pool = ThreadPoolExecutor(
                        self.settings.batch_item_concurrency, thread_name_prefix="sift-item"
                    )
                    self._items = ItemQueue(self.store, pool)
        return self._items

    @property
    def cancel_marks(self) -> CancelMarks:
        """The process's view of which batches have been canceled, shared by its items."""
        if self._marks is None:
            with self._lock:
                if self._marks is None:
                    self._marks = CancelMarks(self.store)
        return self._marks

    @property
    def batches(self) -> AnthropicMessageBatches | None:
        """The Message Batches client of the economy lane (None without a model)."""
        if self._batches is None:
            with self._lock:
                if self._batches is None:
                    from worker.bootstrap import build_batch_client

                    self._batches = build_batch_client(self.settings)
        return self._batches

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            with self._lock:
                if self._runtime is None:
                    self._runtime = load_runtime(self.settings, self.limiter)
                    settle_heap()
        return self._runtime


def load_runtime(settings: Settings, limiter: ProviderLimiter | None = None) -> Runtime:
    """Build the runtime with ``SIFT_RUNTIME_FACTORY`` ("module:function"), or the real one
    wired for the queue: Prometheus recording, and the reranker behind the process's limiter."""
    if settings.runtime_factory:
        module_name, _, attr = settings.runtime_factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        runtime: Runtime = factory(settings)
        return runtime
    from worker.bootstrap import build_reranker, pipeline_config
    from worker.runtime import Runtime as InProcessRuntime
    from worker.runtime import build_runtime

    overrides: dict[str, Any] = {"recorder": metrics.PrometheusRecorder()}
    reranker = build_reranker(settings)
    if reranker is not None:
        inner = metrics.InFlightReranker(reranker)
        overrides["reranker"] = LimitedReranker(inner, limiter) if limiter else inner
    pipeline = build_runtime(settings, **overrides).pipeline
    economy = pipeline.variant(
        config=pipeline_config(settings, price_discount=ECONOMY_PRICE_DISCOUNT),
        recorder=metrics.PrometheusRecorder(lane=LANE_ECONOMY),
    )
    return InProcessRuntime(pipeline, economy)


def settle_heap() -> None:
    """Take what lives as long as the process (the model session, the SDK, the indexes) out
    of the collector's sight, and collect young objects less often: a collection holds the
    GIL, so every search in flight waits on it."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def get_context(settings: Settings | None = None) -> WorkerContext:
    global _context
    if _context is None:
        with _context_lock:
            if _context is None:
                settings = settings or load_settings()
                assert settings.redis_url, "SIFT_REDIS_URL is required"
                _context = WorkerContext(
                    settings=settings,
                    store=JobStore.from_url(
                        settings.redis_url,
                        max_connections=settings.worker_concurrency
                        + settings.batch_item_concurrency
                        + 32,
                        outage_seconds=STORE_OUTAGE_SECONDS,
                    ),
                    limiter=ProviderLimiter(settings.rerank_max_in_flight),
                )
    return _context


def hand_back_items() -> None:
    """The worker is stopping: batch items not yet started go back (:mod:`worker.items`)."""
    context = _context
    if context is not None and context._items is not None:
        context._items.hand_back()


def set_context(context: WorkerContext | None) -> None:
    """Replace the process's context (tests)."""
    global _context
    _context = context


def error_info(exc: BaseException) -> ErrorInfo:
    """The typed error a job record shows for ``exc``."""
    if isinstance(exc, SiftError):
        return ErrorInfo(
            type=exc.code, message=exc.message, retryable=exc.retryable, usage=exc.job_usage
        )
    return ErrorInfo(type="internal_error", message=f"{type(exc).__name__}: {exc}")


class SiftTask(Task):  # type: ignore[misc]
    """The base of every Sift task: timing, delivery counting and the retry decision."""

    acks_late = True
    reject_on_worker_lost = True
    typing = False
    # drops the delivery's record (worker/liveness.py) once it is acked or rejected
    Request = "worker.liveness:OwnedRequest"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        outcome = "ok"
        job_id = str(args[0]) if args and isinstance(args[0], str) else "-"
        if args and isinstance(args[0], dict):  # a webhook event
            job_id = str(args[0].get("data", {}).get("id", "-"))
        try:
            with job_context(job_id):
                return super().__call__(*args, **kwargs)
        except Retry:
            outcome = "retry"
            metrics.TASK_RETRIES.labels(self.name).inc()
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            metrics.TASK_DURATION.labels(self.name, outcome).observe(time.perf_counter() - started)

    @property
    def context(self) -> WorkerContext:
        return get_context(getattr(self.app.conf, "sift_settings", None))

    def should_retry(self, exc: BaseException) -> bool:
        """Retry only Sift errors marked retryable, and only within the retry budget."""
        budget = self.context.settings.task_max_retries
        return isinstance(exc, SiftError) and exc.retryable and self.request.retries < budget

    def backoff(self) -> float:
        """Exponential backoff with full jitter, capped."""
        ceiling = min(RETRY_CAP_SECONDS, RETRY_BASE_SECONDS * 2**self.request.retries)
        return random.uniform(ceiling / 2, ceiling)

    def delivery(self) -> int:
        """Count this delivery of the message: how many there have been, this one included."""
        return self.context.store.count_delivery(str(self.request.id), self.request.retries)

    def poisoned(self, deliveries: int | None = None) -> bool:
        """True when this message has been delivered more times than allowed (worker crashes)."""
        count = self.delivery() if deliveries is None else deliveries
        limit = self.context.settings.task_max_deliveries
        if count > limit:
            log.error(
                "task %s[%s] delivered %d times; failing it as poison",
                self.name,
                self.request.id,
                count,
            )
            return True
        return False

    def hand_back(self, deliveries: int) -> None:
        """The worker is stopping: put this message back on its queue now, for another
        worker. A clean hand-back is no crash, so this delivery is not counted."""
        store = self.context.store
        store.set_deliveries(str(self.request.id), self.request.retries, max(0, deliveries - 1))
        raise Reject("the worker is stopping: handed back", requeue=True)

    def send_webhook(
        self, event_type: str, job_id: str, tenant: str, url: str, status: str
    ) -> None:
        """Enqueue one webhook delivery; its id is stable, so every retry carries the same one."""
        event = webhook_event(event_type, job_id, tenant, url, status)
        self.app.send_task(WEBHOOK_TASK, args=[event], queue=WEBHOOK_QUEUE)


def _completed(kind: str, applied: bool, error: ErrorInfo | None) -> bool:
    """Count a job that just became final (``applied``); answers ``applied``."""
    if applied:
        label = None
        if error is not None:
            label = (
                "internal"
                if error.type in ("internal_error", "delivery_limit_exceeded", "expired")
                else error.type
            )
        metrics.job_completed(kind, "failed" if error else "succeeded", label)
    return applied


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
        if job is not None and job.webhook_url:
            # a redelivery: the worker that finished it may have died before enqueueing the
            # webhook. Send it again; the webhook-id is the same, delivery is at least once.
            self.send_webhook(
                WEBHOOK_EVENT_SEARCH_COMPLETED,
                job_id,
                job.tenant,
                job.webhook_url,
                job.status.value,
            )
        return
    if self.poisoned():
        finished = _completed(
            "search", store.finish_search(job_id, error=_poison_error(self)), _poison_error(self)
        )
    else:
        if not store.start_search(job_id):
            return
        if job.started_at is None:
            metrics.observe_queue_wait(SEARCH_QUEUE, time.time() - job.created_at)
        log.info("search %s: running for tenant %s", job_id, job.tenant)
        try:
            with metrics.running_job():
                result = self.context.runtime.search(job.spec, job.tenant)
        except Exception as exc:
            if self.should_retry(exc):
                log.warning("search %s: retryable error, retrying: %s", job_id, exc)
                store.requeue_search(job_id)
                raise self.retry(exc=exc, countdown=self.backoff()) from exc
            if not isinstance(exc, SiftError):
                log.exception("search %s: unexpected error", job_id)
            error = error_info(exc)
            finished = _completed("search", store.finish_search(job_id, error=error), error)
        else:
            finished = _completed("search", store.finish_search(job_id, result=result), None)
    if finished:
        final = store.get_search_status(job_id)
        log.info("search %s: %s", job_id, final)
        if job.webhook_url and final is not None:
            self.send_webhook(
                WEBHOOK_EVENT_SEARCH_COMPLETED, job_id, job.tenant, job.webhook_url, final.value
            )


@dataclass
class _ModelCheck:
    """The hook a batch item's search runs just before its model call. If the process's
    view of the batch's cancel mark (:class:`CancelMarks`, no round trip of its own most of
    the time) says canceled, one job-store transition (:meth:`JobStore.check_item`) cancels
    the item, atomically, and the search stops (``stopped`` says how it ended)."""

    store: JobStore
    marks: CancelMarks
    batch_id: str
    query_id: str
    stopped: ItemTransition | None = None

    def __call__(self) -> None:
        if not self.marks.canceled(self.batch_id):
            return
        check = self.store.check_item(self.batch_id, self.query_id)
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
    query_ids = store.batch_query_ids(batch_id, start, stop)
    positions = {qid: start + i for i, qid in enumerate(query_ids)}
    items = store.batch_items(batch_id, query_ids)
    deliveries = self.delivery()
    poisoned = self.poisoned(deliveries)
    economy = batch.lane == LANE_ECONOMY
    # self.request is thread-local: take what the item threads need from it here
    may_retry = self.request.retries < self.context.settings.task_max_retries
    first_delivery = self.request.retries == 0
    runtime = self.context.runtime if not poisoned else None
    marks = self.context.cancel_marks

    def to_start(item: BatchItem) -> str | None:
        """The item's query id if it is to be started (a poisoned chunk fails its items as
        they are, and an item without its spec has expired)."""
        return None if poisoned or item.spec is None else item.query_id

    def run(item: BatchItem, started: bool) -> RunOutcome:
        """Run one item: the result or error to finish it with, ``"retry"`` (requeued for
        the chunk's retry), the transition that canceled it (its batch was canceled before
        its model call), or None (nothing to finish: not started, finished by another
        delivery, or left to the economy lane's provider batch)."""
        if poisoned:
            return None, _poison_error(self)
        if not started:
            return None  # canceled meanwhile, or finished by another delivery
        if first_delivery and item.status == "queued":
            metrics.observe_queue_wait(BATCH_QUEUE, time.time() - batch.created_at)
        assert runtime is not None and item.spec is not None
        checked = _ModelCheck(store, marks, batch_id, item.query_id)
        try:
            with metrics.running_job():
                if economy:  # the first half now; the model's answer comes from a provider batch
                    from worker.economy import economy_pipeline, save_prepared

                    prepared = economy_pipeline(self).prepare(item.spec, batch.tenant)
                    if prepared.result is None:
                        save_prepared(
                            store, batch_id, item.query_id, positions[item.query_id], prepared
                        )
                        return None
                    return prepared.result, None
                return runtime.search(item.spec, batch.tenant, checked), None
        except Canceled:  # canceled before its model call, or finished by another delivery
            return checked.stopped if checked.stopped and checked.stopped.applied else None
        except Exception as exc:
            if may_retry and isinstance(exc, SiftError) and exc.retryable:
                store.requeue_item(batch_id, item.query_id)
                return "retry"
            if not isinstance(exc, SiftError):
                log.exception("batch %s item %s: unexpected error", batch_id, item.query_id)
            return None, error_info(exc)

    def finished(transition: ItemTransition, error: ErrorInfo | None) -> None:
        if not transition.canceled:
            _completed("batch_item", transition.applied, error)
        elif transition.applied:
            metrics.job_completed("batch_item", "canceled")

    pending = [item for item in items if not item.status.final]
    chunk = self.context.items.run(Chunk(batch_id, to_start, run, finished), pending)
    outcomes = chunk.outcomes
    completed = any(done for done, _ in outcomes)
    to_retry = sum(1 for _, retry in outcomes if retry)
    # A redelivered chunk with nothing left to run, of a finished batch: the worker that
    # completed the batch may have died before enqueueing its webhook, so send it again.
    resend = deliveries > 1 and not pending and batch.finished_at is not None
    if completed or resend:
        log.info("batch %s: completed%s", batch_id, " (webhook sent again)" if resend else "")
        done = store.get_batch(batch_id)
        status = done.status.value if done else "succeeded"
        if completed:
            metrics.job_completed("batch", status)  # once: only one transition completes it
        if batch.webhook_url:
            self.send_webhook(
                WEBHOOK_EVENT_BATCH_COMPLETED, batch_id, batch.tenant, batch.webhook_url, status
            )
    if chunk.error is not None:  # a runner broke: fail the task (its completion is sent)
        raise chunk.error
    if chunk.handed_back:
        log.info("batch %s: worker stopping, %d items handed back", batch_id, chunk.handed_back)
        self.hand_back(deliveries)
    if economy and not to_retry:
        from worker.economy import maybe_submit

        maybe_submit(self, batch_id)
    if to_retry:
        log.warning(
            "batch %s: %d items hit retryable errors; retrying the chunk", batch_id, to_retry
        )
        raise self.retry(countdown=self.backoff())


@shared_task(  # type: ignore[untyped-decorator]
    name=INGEST_TASK, base=SiftTask, bind=True
)
def ingest(self: SiftTask, job_id: str) -> None:
    """Upsert one ingest job's documents into the tenant's index."""
    store = self.context.store
    job = store.get_ingest(job_id)
    if job is None or job.status.final:
        return
    if self.poisoned():
        _completed(
            "ingest", store.finish_ingest(job_id, error=_poison_error(self)), _poison_error(self)
        )
        return
    documents = store.ingest_documents(job_id)
    if documents is None:
        store.finish_ingest(job_id, error=ErrorInfo(type="expired", message="documents expired"))
        return
    if not store.start_ingest(job_id):
        return
    try:
        upserted = self.context.runtime.ingest(job.index, job.tenant, documents)
    except Exception as exc:
        if self.should_retry(exc):
            store.requeue_ingest(job_id)
            raise self.retry(exc=exc, countdown=self.backoff()) from exc
        if not isinstance(exc, SiftError):
            log.exception("ingest %s: unexpected error", job_id)
        error = error_info(exc)
        _completed("ingest", store.finish_ingest(job_id, error=error), error)
        return
    _completed("ingest", store.finish_ingest(job_id, upserted=upserted), None)
    log.info("ingest %s: %d documents into %s", job_id, upserted, job.index)


@shared_task(  # type: ignore[untyped-decorator]
    name=WEBHOOK_TASK, base=SiftTask, bind=True, max_retries=None
)
def webhook(self: SiftTask, event: dict[str, Any]) -> None:
    """Deliver one signed webhook; :func:`worker.webhooks.run_delivery` decides the retry."""
    from worker import webhooks

    settings = self.context.settings
    secrets = next(
        (k.webhook_secrets() for k in settings.all_api_keys() if k.tenant == event["tenant"]), None
    )
    data = event["data"]
    if secrets is None:
        log.error(
            "webhook for %s: tenant %s has no key and no secret; dropped",
            data["id"],
            event["tenant"],
        )
        return
    decision = webhooks.run_delivery(
        url=event["url"],
        event_type=event["type"],
        job_id=data["id"],
        status=data["status"],
        occurred_at=event["occurred_at"],
        attempt=self.request.retries + 1,
        secrets=secrets,
        settings=settings,
    )
    metrics.webhook_delivery(decision.result.outcome.value)
    if decision.retry_in is not None:
        raise self.retry(countdown=decision.retry_in)
