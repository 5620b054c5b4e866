"""What every Sift task shares: the worker process's context (settings, job store, provider
limiter, runtime, item queue), built once on first use, and :class:`SiftTask`, the base class
that times a task, counts its deliveries so a poison message is failed instead of looping, and
owns the retry decision.

:mod:`worker.queue.tasks` and :mod:`worker.queue.economy` both build on it, so neither imports
the other for it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from celery import Task
from celery.exceptions import Reject, Retry
from kombu.transport.virtual.base import W_NO_CONSUMERS
from tenacity import RetryCallState, Retrying, wait_exponential, wait_random_exponential

from worker.constants import (
    ECONOMY_PRICE_DISCOUNT,
    LANE_ECONOMY,
    WEBHOOK_EVENT_BATCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.contract import DocumentIn, ErrorInfo, SearchResult, SearchSpec
from worker.core.pipeline import BeforeModel
from worker.core.ports import AnswerKeeper
from worker.errors import ConfigError, RerankFailed, SiftError, TenantRemoved
from worker.observability import metrics
from worker.observability.logcontext import job_context
from worker.queue.intake import INTAKE
from worker.queue.items import CancelMarks, ItemQueue
from worker.queue.jobstore import BatchJob, JobStore, webhook_event
from worker.redis_client import OUTAGE_SECONDS, worker_connections
from worker.runtime.ratelimit import LimitedReranker, ProviderLimiter
from worker.settings import Settings, load_settings

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

log = logging.getLogger(__name__)


class HandBack(Reject):  # type: ignore[misc]
    """The worker is stopping: this message goes back on its queue, for another worker."""

    def __init__(self, reason: str = "the worker is stopping: handed back", requeue: bool = True):
        super().__init__(reason, requeue)


class QuietHandBacks(logging.Filter):
    """Celery logs every rejected message at WARNING with a traceback; a hand-back is a clean
    stop, so it is one INFO line (``Task ... reject requeue=True: ... handed back``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HandBack):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = None
        return True


QUIET_HAND_BACKS = QuietHandBacks()  # one instance: adding it again changes nothing


class QuietRequeues(logging.Filter):
    """A stop cancels the worker's consumers while a fetch may still be out: kombu then gets
    a message for a queue it no longer consumes and puts it back with a WARNING
    (``Requeuing undeliverable message for queue ...: No consumers``). It goes back for
    another worker, as a hand-back does: one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == W_NO_CONSUMERS:
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


QUIET_REQUEUES = QuietRequeues()

RETRY_BASE_SECONDS = 1.0
RETRY_CAP_SECONDS = 60.0
# A task's wait before its retry: equal jitter, between half a ceiling and the ceiling, which
# doubles from RETRY_BASE_SECONDS with each retry up to RETRY_CAP_SECONDS. Half of it is fixed,
# so a retry never comes straight back at a backend that is down; the other half is random.
_HALF = {"multiplier": RETRY_BASE_SECONDS / 2, "max": RETRY_CAP_SECONDS / 2}
RETRY_WAIT = wait_exponential(**_HALF) + wait_random_exponential(**_HALF)
# Allocations between young-generation collections, once the runtime is built (Python's
# default is 700): with hundreds of searches in flight, collections cost ~8% of the CPU.
GC_YOUNG_THRESHOLD = 20_000


class Runtime(Protocol):
    """What the tasks need from :mod:`worker.runtime.inprocess`."""

    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: AnswerKeeper | None = None,
    ) -> SearchResult:
        """``before_model`` runs just before the model call (and each retry of it, handed
        what was billed so far) and may raise ``Canceled``;
        ``spent`` is the deadline's time earlier runs of the search used; ``answers`` keeps
        the model's answer past the process (the run claim), or has an earlier run's."""
        ...

    def ingest(
        self,
        index: str,
        tenant: str,
        documents: list[DocumentIn],
        progress: Callable[[int], None] | None = None,
        *,
        version: int | None = None,
    ) -> int: ...


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
    _tenants: frozenset[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, tenant: str) -> None:
        """The one gate every job of a tenant passes where it would start (a search, a batch
        item of either lane, an ingest or delete, an economy submission): raises
        :class:`TenantRemoved` for a tenant none of the worker's keys names, so a tenant
        removed while its work waited in the queue has none of it run nor billed. Each caller
        ends the job through its own failure path (``failed``, ``tenant_removed``), which keeps
        the counts and metrics true. The keys are the ones read at the worker's start
        (:meth:`Settings.all_api_keys`), as its webhooks are signed with. A worker given no key
        at all (a test's, or a runtime driven without a gateway) admits every tenant: it cannot
        tell a removed tenant from none configured."""
        if self._tenants is None:
            self._tenants = frozenset(key.tenant for key in self.settings.all_api_keys())
        if self._tenants and tenant not in self._tenants:
            raise TenantRemoved(tenant)

    @property
    def items(self) -> ItemQueue:
        """The batch items of the process's chunks, run by ``SIFT_BATCH_ITEM_CONCURRENCY``
        threads (:mod:`worker.queue.items`)."""
        if self._items is None:
            with self._lock:
                if self._items is None:
                    pool = ThreadPoolExecutor(
                        self.settings.batch_item_concurrency, thread_name_prefix="sift-item"
                    )
                    # past a pool's worth of items waiting, other processes take the rest
                    self._items = ItemQueue(
                        self.store, pool, INTAKE, high=self.settings.batch_item_concurrency
                    )
                    if INTAKE.stopping:  # a chunk taken as the stop began goes back at once
                        self._items.hand_back()
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
                    from worker.runtime.bootstrap import build_batch_client

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


def runtime_factory(settings: Settings) -> Callable[[Settings], Any] | None:
    """``SIFT_RUNTIME_FACTORY``'s function, imported; a ConfigError naming the variable when
    it cannot be. ``sift worker`` calls it before Celery starts: the import was made at the
    first job, so a worker given a module that is not there started, and failed every job."""
    if not settings.runtime_factory:
        return None
    module_name, _, attr = settings.runtime_factory.partition(":")
    where = f"SIFT_RUNTIME_FACTORY={settings.runtime_factory}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import {module_name}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{where}: {module_name} has no function {attr}")
    return factory  # type: ignore[no-any-return]


def load_runtime(settings: Settings, limiter: ProviderLimiter | None = None) -> Runtime:
    """Build the runtime with ``SIFT_RUNTIME_FACTORY`` ("module:function"), or the real one
    wired for the queue: Prometheus recording, the reranker behind the process's limiter, and
    the rate budget that every worker process shares."""
    factory = runtime_factory(settings)
    if factory is not None:
        runtime: Runtime = factory(settings)
        return runtime
    from worker.runtime.bootstrap import build_rate_budget, build_reranker, pipeline_config
    from worker.runtime.inprocess import Runtime as InProcessRuntime
    from worker.runtime.inprocess import build_runtime

    overrides: dict[str, Any] = {
        "recorder": metrics.PrometheusRecorder(),
        "slot_waited": metrics.slot_waited,
    }
    budget = build_rate_budget(settings)  # one budget for every worker process, in Redis
    reranker = build_reranker(settings, on_headers=budget.learn if budget else None)
    if budget is not None:
        overrides["rate_budget"] = budget
    if reranker is not None:
        inner = metrics.InFlightReranker(reranker)
        # a 429 pauses the cluster through the budget (where a cancel is checked after the
        # wait); the process's own pause only without one
        limited = LimitedReranker(inner, limiter, pauses=budget is None) if limiter else None
        overrides["reranker"] = limited or inner
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
                        max_connections=worker_connections(settings),
                        outage_seconds=OUTAGE_SECONDS,
                        result_ttl=settings.result_retention_seconds,
                    ),
                    limiter=ProviderLimiter(settings.rerank_max_in_flight),
                )
    return _context


def warm_up(settings: Settings) -> None:
    """Build the process's runtime and let it load what its first job would (its
    ``warm_up``, when it has one); a failure is logged, and the first job meets it again."""
    try:
        runtime = get_context(settings).runtime
        ready = getattr(runtime, "warm_up", None)
        if callable(ready):
            ready()
    except Exception as exc:
        log.warning("warm-up failed, the first job will try again: %s: %s", type(exc).__name__, exc)


def hand_back_items() -> None:
    """The worker is stopping: its consumer is to take no more messages, and the batch items
    not yet started go back at once (:mod:`worker.queue.items`). This waits for no cancel:
    each chunk's :meth:`SiftTask.hand_back` does before its message goes back, so none comes
    back to this process (on the ``solo`` pool the chunk runs in the event loop that would
    cancel it: a 429's pause ended during such a wait, and its retry was sent). Marked
    stopping first: an item queue made after this is born closed."""
    INTAKE.stop_taking(timeout=0)
    context = _context
    if context is not None and context._items is not None:
        context._items.hand_back()


def items_running() -> int:
    """How many batch items this process is running now (:meth:`ItemQueue.running`)."""
    context = _context
    return context._items.running() if context is not None and context._items is not None else 0


def tasks_running() -> dict[str, int]:
    """How many Celery tasks this process is running now, by name (Celery's active requests,
    the pool's prefork children's included): at a stop's deadline, what held it besides
    batch items (a search in its model call, an ingest, a webhook's POST)."""
    from celery.worker.state import active_requests

    for _ in range(3):  # a task ending on another thread changes the set mid-count
        with contextlib.suppress(RuntimeError):
            return dict(Counter(request.name for request in list(active_requests)))
    return {}


def set_context(context: WorkerContext | None) -> None:
    """Replace the process's context (tests)."""
    global _context
    _context = context


class WaitHop(Retry):  # type: ignore[misc]
    """A task's wait for its next attempt, handed on to a message of its own (a webhook's
    waits outlast the broker's visibility timeout, so they are made in hops): a Celery retry
    to the broker, but no retry of the work, so it is not counted as one."""


def error_info(exc: BaseException) -> ErrorInfo:
    """The typed error a job record shows for ``exc``. Anything but a Sift error is
    ``internal_error`` naming the exception's class alone: its text is the library's, and
    may name the infrastructure (a Redis or backend host and port), which the tenant reading
    the record must not see; the worker's log has it (the caller logs the traceback).

    >>> error_info(ConnectionError("Error 111 connecting to 10.0.0.5:6379.")).message
    'unexpected ConnectionError in the worker (its log has the detail)'
    """
    if isinstance(exc, SiftError):
        info = ErrorInfo(
            type=exc.code,
            message=exc.message,
            retryable=exc.retryable,
            # no request sent (the rate budget refused the only attempt, or no model):
            # nothing billed, no usage (null), as for a failure before the rerank
            usage=exc.job_usage if exc.job_usage is not None and exc.job_usage.requests else None,
            reason=exc.reason if isinstance(exc, RerankFailed) else None,
            trace=exc.job_trace,
        )
        info._stage_seconds = dict(exc.job_seconds or {})
        return info
    message = f"unexpected {type(exc).__name__} in the worker (its log has the detail)"
    return ErrorInfo(type="internal_error", message=message)


def job_id_of(args: Sequence[Any] | None) -> str:
    """The job a task's arguments name, as its log records show it: the first argument (a
    job id), or a webhook event's ``data.id``; "-" for none.

    >>> job_id_of(["srch_1"]), job_id_of([{"data": {"id": "bat_2"}}]), job_id_of(None)
    ('srch_1', 'bat_2', '-')
    """
    first = args[0] if args else None
    if isinstance(first, dict):  # a webhook event
        return str(first.get("data", {}).get("id", "-"))
    return first if isinstance(first, str) else "-"


class SiftTask(Task):  # type: ignore[misc]
    """The base of every Sift task: timing, delivery counting and the retry decision."""

    acks_late = True
    reject_on_worker_lost = True
    typing = False
    # drops the delivery's record (worker/queue/liveness.py) once it is acked or rejected
    Request = "worker.queue.liveness:OwnedRequest"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        outcome = "ok"
        try:
            # (in a worker, Celery's own lines around the call carry it too: celery_app.py)
            with job_context(job_id_of(args)):
                return super().__call__(*args, **kwargs)
        except WaitHop:
            outcome = "wait"  # a wait going on in a message of its own: no retry
            raise
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
        """Exponential backoff with equal jitter (:data:`RETRY_WAIT`) for this retry."""
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = self.request.retries + 1
        return RETRY_WAIT(state)

    def delivery(self, job_id: str | None = None) -> int:
        """Count this delivery of the message (of the job ``job_id``: the return of one an
        outage ended is not counted): how many there have been, this one included."""
        return self.context.store.count_delivery(*self.delivered(), job_id)

    def delivered(self) -> tuple[str, int]:
        """This message's delivery counter: its task id and retry number."""
        return str(self.request.id), self.request.retries

    def poisoned(self, deliveries: int | None = None, job_id: str | None = None) -> bool:
        """True when this message (of the job ``job_id``) has been delivered more times than
        allowed (worker crashes)."""
        count = self.delivery(job_id) if deliveries is None else deliveries
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
        INTAKE.stop_taking()  # this process's consumer is cancelled first: not taken back here
        raise HandBack()

    def send_webhook(
        self, event_type: str, job_id: str, tenant: str, url: str, status: str
    ) -> None:
        """Enqueue one webhook delivery; its id is stable, so every retry carries the same one.
        None for a webhook already settled: a removed tenant's, settled ``failed`` by the move
        that made its job final (nothing can sign it)."""
        if self.context.store.webhook_was_settled(job_id):
            log.info("webhook %s: settled already; none queued", job_id)
            return
        event = webhook_event(event_type, job_id, tenant, url, status)
        self.app.send_task(WEBHOOK_TASK, args=[event], queue=WEBHOOK_QUEUE)

    def announce_batch(self, batch: BatchJob, status: str) -> None:
        """Enqueue a finished batch's ``batch.completed`` webhook, if it asked for one."""
        if batch.webhook_url:
            self.send_webhook(
                WEBHOOK_EVENT_BATCH_COMPLETED, batch.id, batch.tenant, batch.webhook_url, status
            )


def count_completed(kind: str, applied: bool, error: ErrorInfo | None) -> bool:
    """Count a job that just became final (``applied``); answers ``applied``."""
    if applied:  # a failure's label is its record's error.type, whatever it is
        label = None if error is None else error.type
        metrics.job_completed(kind, "failed" if error else "succeeded", label)
    return applied
