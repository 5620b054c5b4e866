"""Every metric Sift defines, and the known series made at zero at start-up so dashboards and
rates see them before the first event.

Every metric has labels, so no value exists until the first ``labels()`` call: that is what
lets :func:`~worker.observability.metrics.setup_multiprocess` switch to file-backed values
after the metrics are imported, and refuse once one of :data:`ALL_METRICS` has a value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import Counter, Gauge, Histogram

from worker.constants import LANES, POLICY_ID
from worker.observability.metrics._jobs import (
    INDEX_READ_OPERATIONS,
    INDEX_READS_DROPPED,
    JOB_ERRORS,
    JOB_FAILURES,
    JOB_KINDS,
    JOB_STATUSES,
    JOBS_COMPLETED,
    JOBS_IN_FLIGHT,
    JOBS_SUBMITTED,
    QUEUE_BACKLOG,
    QUEUE_WAIT,
    REDRIVE_KINDS,
    REDRIVEN,
    TASK_DURATION,
    TASK_RETRIES,
    WEBHOOK_DEFERRALS,
    WEBHOOK_DELIVERIES,
    WEBHOOK_EVENTS,
    WEBHOOK_RESULTS,
)
from worker.observability.metrics._processes import CLOCK_SKEW, WORKER_PROCESSES, WORKER_RESTARTS
from worker.observability.metrics._rerank import (
    ATTEMPT_RESULTS,
    BUDGET_UNSETTLED,
    BUDGET_WAIT,
    PROVIDER_429,
    PROVIDER_DELETE_RESULTS,
    PROVIDER_DELETES,
    PROVIDER_DELETES_REFUSED,
    RERANK_ATTEMPTS,
    RERANK_COST,
    RERANK_DURATION,
    RERANK_DURATION_OUTCOMES,
    RERANK_IN_FLIGHT,
    RERANK_OUTCOME_VALUES,
    RERANK_OUTCOMES,
    RERANK_TOKENS,
    RERANK_UNPRICED,
    RERANK_UNREAD,
    RERANK_UNREAD_INPUT,
    TOKEN_TYPES,
)
from worker.observability.metrics._search import (
    CPU_SLOT_WAIT,
    NATIVE_FUSION_CHANNEL,
    RETRIEVAL_CHANNELS,
    RETRIEVAL_DURATION,
    RETRIEVAL_HITS,
    SEARCH_DURATION,
    SEARCH_MODES,
    SEARCH_OUTCOMES,
    SLOT_LINES,
)

ALL_METRICS: Final[tuple[Counter | Gauge | Histogram, ...]] = (
    SEARCH_DURATION,
    QUEUE_WAIT,
    RETRIEVAL_DURATION,
    RETRIEVAL_HITS,
    CPU_SLOT_WAIT,
    RERANK_DURATION,
    RERANK_TOKENS,
    RERANK_ATTEMPTS,
    RERANK_OUTCOMES,
    RERANK_COST,
    RERANK_UNPRICED,
    RERANK_UNREAD,
    RERANK_UNREAD_INPUT,
    RERANK_IN_FLIGHT,
    JOBS_IN_FLIGHT,
    WEBHOOK_DELIVERIES,
    WEBHOOK_DEFERRALS,
    INDEX_READS_DROPPED,
    QUEUE_BACKLOG,
    JOBS_SUBMITTED,
    JOBS_COMPLETED,
    JOB_FAILURES,
    REDRIVEN,
    TASK_DURATION,
    TASK_RETRIES,
    BUDGET_WAIT,
    BUDGET_UNSETTLED,
    PROVIDER_429,
    PROVIDER_DELETES,
    PROVIDER_DELETES_REFUSED,
    WORKER_PROCESSES,
    WORKER_RESTARTS,
    CLOCK_SKEW,
)


def preregister(
    models: Iterable[str] = (),
    backend: str | None = None,
    queues: Iterable[str] = (),
    lanes: Iterable[str] = LANES,
    native_fusion: bool = False,
    tasks: Iterable[str] = (),
) -> None:
    """Create the known series at zero, so dashboards and rates see them before the first event.
    ``native_fusion``: the backend fuses both channels itself (``Settings.native_fusion``),
    the only case with an ``rrf`` stage. ``tasks``: a worker's Celery tasks, whose retries it
    counts (``sift_task_duration_seconds`` is left to its first run: a histogram's series take
    some 20 entries each in a multiprocess file, and 34 of them doubled the file).

    Call it once at start-up, in the supervising process in multiprocess mode.
    """
    for model in models:
        for lane in lanes:
            for result in ATTEMPT_RESULTS:
                RERANK_ATTEMPTS.labels(model, result, lane)
            for outcome in RERANK_DURATION_OUTCOMES:
                RERANK_DURATION.labels(model, outcome, lane)
            for token_type in TOKEN_TYPES:
                RERANK_TOKENS.labels(model, token_type, lane)
            RERANK_COST.labels(model, lane)
            RERANK_UNPRICED.labels(model, lane)
            RERANK_UNREAD.labels(model, lane)
            RERANK_UNREAD_INPUT.labels(model, lane)
            BUDGET_WAIT.labels(model, lane)
            BUDGET_UNSETTLED.labels(model, lane)
            PROVIDER_429.labels(model, lane)
        RERANK_IN_FLIGHT.labels(model).set(0)
    for outcome in RERANK_OUTCOME_VALUES:
        RERANK_OUTCOMES.labels(POLICY_ID, outcome)
    for mode in SEARCH_MODES:
        for outcome in SEARCH_OUTCOMES:
            SEARCH_DURATION.labels(mode, outcome)
    if backend is not None:  # a worker's: its searches' CPU slots
        for line in SLOT_LINES:
            CPU_SLOT_WAIT.labels(line)
        for channel in RETRIEVAL_CHANNELS:
            if channel == NATIVE_FUSION_CHANNEL:
                if native_fusion:  # its kept candidates are counted as "fuse"'s
                    RETRIEVAL_DURATION.labels(backend, channel)
                continue
            RETRIEVAL_DURATION.labels(backend, channel)
            if channel != "embed":
                RETRIEVAL_HITS.labels(backend, channel)
    for queue in queues:
        QUEUE_WAIT.labels(queue)
    for task in tasks:
        TASK_RETRIES.labels(task)
    for kind in JOB_KINDS:
        JOBS_SUBMITTED.labels(kind)
        for status in JOB_STATUSES:
            JOBS_COMPLETED.labels(kind, status)
        for error in JOB_ERRORS:
            JOB_FAILURES.labels(kind, error)
    JOBS_IN_FLIGHT.labels("running").set(0)  # "queued" is the job store's to report
    for result in WEBHOOK_RESULTS:
        WEBHOOK_DELIVERIES.labels(result)
    for event_type in WEBHOOK_EVENTS:
        WEBHOOK_DEFERRALS.labels(event_type)
    for kind in REDRIVE_KINDS:
        REDRIVEN.labels(kind)
    for operation in INDEX_READ_OPERATIONS:
        INDEX_READS_DROPPED.labels(operation)
    for result in PROVIDER_DELETE_RESULTS:
        PROVIDER_DELETES.labels(result)
