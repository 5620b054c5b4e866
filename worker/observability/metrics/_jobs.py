"""What the queue measures: jobs submitted, running and done (a failed one by its error class),
their wait in the queue and each queue's backlog, each Celery task's run and retries, the
re-drive's resends, and the webhook deliveries and those put off."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any, Final, Protocol

from prometheus_client import Counter, Gauge, Histogram

from worker.constants import (
    ERROR_TENANT_REMOVED,
    METRIC_INDEX_READS_DROPPED,
    METRIC_JOB_FAILURES,
    METRIC_JOBS_COMPLETED,
    METRIC_JOBS_IN_FLIGHT,
    METRIC_JOBS_SUBMITTED,
    METRIC_QUEUE_BACKLOG,
    METRIC_QUEUE_WAIT,
    METRIC_REDRIVEN,
    METRIC_TASK_DURATION,
    METRIC_TASK_RETRIES,
    METRIC_WEBHOOK_DEFERRALS,
    METRIC_WEBHOOK_DELIVERIES,
    WEBHOOK_EVENT_BATCH_COMPLETED,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    kombu_queue_keys,
)
from worker.observability.metrics._recording import child, closed, never_raises

# --- closed label sets ---
JOB_STATES: Final = ("queued", "running")
# no "webhook": a delivery is sift_webhook_deliveries_total's, and a kind="webhook" job series,
# counted by nothing, read 0 submitted and 0 completed while webhooks went out
JOB_KINDS: Final = ("search", "batch", "batch_item", "ingest")
JOB_STATUSES: Final = ("succeeded", "failed", "canceled")
# a failed job's ``error.type``, exactly: the SiftError.code values (worker/errors.py), and the
# three a record gets otherwise (worker/queue/base.py's error_info, worker/queue/tasks/). The
# label was "internal" for those three: a crash loop's jobs, expired documents and a bug in one
JOB_ERRORS: Final = (
    "invalid_request",
    "config_error",
    "mode_unavailable",
    "index_not_found",
    "embedding_model_mismatch",
    "index_limit_reached",
    ERROR_TENANT_REMOVED,
    "backend_error",
    "backend_unavailable",
    "backend_request_error",
    "rerank_attempt_failed",
    "rerank_failed",
    "deadline_exceeded",
    "internal_error",
    "delivery_limit_exceeded",
    "expired",
)
WEBHOOK_RESULTS: Final = ("delivered", "retry", "failed")
WEBHOOK_EVENTS: Final = (WEBHOOK_EVENT_SEARCH_COMPLETED, WEBHOOK_EVENT_BATCH_COMPLETED)
REDRIVE_KINDS: Final = ("search", "batch", "ingest", "economy", "webhook")
# the index reads a gateway sends (api_gateway/indexes.py), "update" a settings change
INDEX_READ_OPERATIONS: Final = ("list", "show", "update", "documents", "document")

# --- buckets ---
# From a search taken at once (a few ms) to a day (a webhook retry's hours, a search queued
# while the workers were down overnight), no two bounds more than 2.5 times apart: Prometheus
# interpolates within a bucket, and with bounds five times apart (1 s, then 5 s) a wait of
# 1.1 s read 4.8 s at p95; past the last bound every wait reads as that bound.
QUEUE_WAIT_BUCKETS: Final = (
    0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 57600.0, 86400.0,
)  # fmt: skip

# --- the metrics ---
QUEUE_WAIT = Histogram(
    METRIC_QUEUE_WAIT,
    "Seconds from a job's submission to a worker starting it, by queue; a webhook attempt: "
    "from when it was due (its job's end, or its retry's time) to its run.",
    ["queue"],
    buckets=QUEUE_WAIT_BUCKETS,
)
JOBS_IN_FLIGHT = Gauge(
    METRIC_JOBS_IN_FLIGHT,
    "Jobs this fleet holds right now, by state.",
    ["state"],
    multiprocess_mode="livesum",
)
WEBHOOK_DELIVERIES = Counter(
    METRIC_WEBHOOK_DELIVERIES,
    "Webhook delivery attempts, by result (delivered; retry: another attempt follows; "
    "failed: none does, refused or the schedule spent).",
    ["result"],
)
WEBHOOK_DEFERRALS = Counter(
    METRIC_WEBHOOK_DEFERRALS,
    "Webhook deliveries put off because their process already sent "
    "SIFT_WEBHOOK_DELIVERIES_PER_PROCESS at once, or their tenant "
    "SIFT_WEBHOOK_DELIVERIES_PER_TENANT (a hop of 1-3 s, no attempt spent), by event type.",
    ["type"],
)
INDEX_READS_DROPPED = Counter(
    METRIC_INDEX_READS_DROPPED,
    "Index reads and settings changes a worker took after their gateway had given up "
    "waiting (INDEX_READ_TIMEOUT_SECONDS), dropped unrun, by operation.",
    ["operation"],
)
QUEUE_BACKLOG = Gauge(
    METRIC_QUEUE_BACKLOG,
    "Messages waiting in a Celery queue (Redis LLEN), as last read.",
    ["queue"],
    multiprocess_mode="livemostrecent",
)
JOBS_SUBMITTED = Counter(
    METRIC_JOBS_SUBMITTED,
    "Jobs accepted by the gateway, by kind.",
    ["kind"],
)
JOBS_COMPLETED = Counter(
    METRIC_JOBS_COMPLETED,
    "Jobs that reached a final status, by kind and status.",
    ["kind", "status"],
)
JOB_FAILURES = Counter(
    METRIC_JOB_FAILURES,
    "Jobs that failed, by kind and error class (the SiftError code).",
    ["kind", "error"],
)
REDRIVEN = Counter(
    METRIC_REDRIVEN,
    "Task messages the re-drive enqueued again because the broker had lost them, by job kind "
    "(a batch counts one per chunk).",
    ["kind"],
)
# The queue's task metrics (extensions to §9): how long each Celery task ran, how often one
# was put back for a retry.
TASK_DURATION = Histogram(
    METRIC_TASK_DURATION,
    "Wall time of one Celery task run, by task and outcome (ok, retry, error; wait: a "
    "webhook's hop toward its next attempt).",
    ["task", "outcome"],
    # up to the longest time limit a task has at the defaults (a batch chunk's: ~770 s)
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900),
)
TASK_RETRIES = Counter(
    METRIC_TASK_RETRIES,
    "Tasks put back for a retry after a retryable error (not a webhook's hop of its wait).",
    ["task"],
)


@never_raises
def observe_queue_wait(queue: str, seconds: float) -> None:
    """A worker started a job ``seconds`` after it was submitted to ``queue``."""
    child(QUEUE_WAIT, queue).observe(max(0.0, seconds))


@never_raises
def job_submitted(kind: str, count: int = 1) -> None:
    """The gateway accepted ``count`` jobs of ``kind`` (a batch adds one per item)."""
    JOBS_SUBMITTED.labels(closed(kind, JOB_KINDS, "kind")).inc(count)


@never_raises
def job_completed(kind: str, status: str, error: str | None = None, count: int = 1) -> None:
    """``count`` jobs reached a final status; a failed one also counts under its error class."""
    kind = closed(kind, JOB_KINDS, "kind")
    child(JOBS_COMPLETED, kind, closed(status, JOB_STATUSES, "status")).inc(count)
    if status == "failed":
        label = closed(error or "internal_error", JOB_ERRORS, "error")
        JOB_FAILURES.labels(kind, label).inc(count)


def cancel_counted(items: int, completed: bool) -> None:
    """What a batch's cancel ended, taken once from its record (the gateway that heard the
    cancel, or the worker that took its count message): ``items`` canceled, and the batch if
    the cancel completed it (a cancel that completes its batch canceled an item: canceled)."""
    if items:
        job_completed("batch_item", "canceled", count=items)
    if completed:
        job_completed("batch", "canceled")


@contextlib.contextmanager
def running_job() -> Iterator[None]:
    """Counts one job in ``sift_jobs_in_flight{state="running"}`` while the block runs."""
    gauge = child(JOBS_IN_FLIGHT, "running")
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


@never_raises
def redriven(kind: str, count: int = 1) -> None:
    """The re-drive enqueued ``count`` lost task messages of a job of ``kind`` again."""
    REDRIVEN.labels(closed(kind, REDRIVE_KINDS, "kind")).inc(count)


@never_raises
def webhook_delivery(result: str) -> None:
    """One webhook delivery attempt ended with ``result``: delivered, retry or failed."""
    WEBHOOK_DELIVERIES.labels(closed(result, WEBHOOK_RESULTS, "result")).inc()


@never_raises
def webhook_deferred(event_type: str) -> None:
    """A webhook of ``event_type`` was put off: every delivery slot of its process, or its
    tenant's share of them, was sending."""
    WEBHOOK_DEFERRALS.labels(closed(event_type, WEBHOOK_EVENTS, "type")).inc()


@never_raises
def index_read_dropped(operation: str) -> None:
    """An index read (or settings change) of ``operation`` came after its gateway's wait had
    ended: dropped unrun, its answer awaited by no one."""
    INDEX_READS_DROPPED.labels(closed(operation, INDEX_READ_OPERATIONS, "operation")).inc()


class RedisLike(Protocol):
    """The one Redis call :func:`update_backlog` needs (redis-py's ``Redis`` has it)."""

    def llen(self, name: str) -> Any: ...


def update_backlog(redis_client: RedisLike, queues: Iterable[str]) -> dict[str, int]:
    """Read each Celery queue's length from Redis into ``sift_queue_backlog``; answers them.

    >>> update_backlog(redis.Redis.from_url(url), [SEARCH_QUEUE, WEBHOOK_QUEUE])  # doctest: +SKIP
    {'sift.search': 12, 'sift.webhooks': 0}
    """
    lengths: dict[str, int] = {}
    for queue in queues:
        lengths[queue] = sum(int(redis_client.llen(key)) for key in kombu_queue_keys(queue))
        QUEUE_BACKLOG.labels(queue).set(lengths[queue])
    return lengths


def job_store_unread(queues: Iterable[str]) -> None:
    """The job store could not be read: ``sift_jobs_in_flight{state="queued"}`` and each
    queue's ``sift_queue_backlog`` become NaN, not the last values read. A gateway kept
    serving those, and the dashboards' and alerts' max over replicas showed a stale high
    count as now; Prometheus's ``max`` passes over a NaN while another replica reads."""
    JOBS_IN_FLIGHT.labels("queued").set(math.nan)
    for queue in queues:
        QUEUE_BACKLOG.labels(queue).set(math.nan)
