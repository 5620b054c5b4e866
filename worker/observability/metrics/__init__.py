"""Sift's Prometheus metrics: each DESIGN.md §9 metric defined once, the recorder, the exposition.

This package depends on ``prometheus_client`` and :mod:`worker.constants` only, so the gateway
can import it without the search core. Its modules, by what they measure or do:

* ``_search``: the search and its retrieval channels; ``_rerank``: the model calls, their
  tokens, cost and rate limits; ``_jobs``: jobs, queues, tasks, the re-drive and webhooks;
  ``_processes``: a ``sift worker`` supervisor's worker processes;
* ``_recorder``: :class:`PrometheusRecorder`; ``_series``: every metric and
  :func:`preregister`; ``_recording``: closed label sets and the kept children;
* ``_multiprocess``: the value files and their sweep; ``_allocated``: those files with their
  blocks allocated, so a full disk drops values instead of a SIGBUS; ``_exposition``: serving
  ``/metrics``.

Import the names from here: ``from worker.observability import metrics``.

Who calls what:

* the pipeline reports through :class:`PrometheusRecorder` (the ``Recorder`` port);
* a Celery task calls :func:`observe_queue_wait`, :func:`job_completed` and
  :func:`running_job`; the webhook task calls :func:`webhook_delivery` and
  :func:`webhook_deferred`; the index read task calls :func:`index_read_dropped`;
* the gateway calls :func:`job_submitted`; on each scrape its own ``/metrics`` route (behind
  ``SIFT_METRICS_TOKEN`` when set) sets the queued jobs from the job store and calls
  :func:`update_backlog` (:func:`job_store_unread` when Redis does not answer), then serves
  :func:`metrics_response`;
* a worker's main process calls :func:`serve_worker_metrics` (its series at zero, then
  :func:`start_worker_metrics_server`); a ``sift worker``
  supervisor calls :func:`worker_processes` and :func:`worker_restart`;
* a worker's liveness beat and the gateway's clock reads call :func:`clock_skew`.

Multiprocess mode. Where a process forks (Celery prefork, several gateway workers) each
process writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` and the exposition sums
them. That variable is prometheus-client's own (as ``ANTHROPIC_BASE_URL`` is the SDK's), so it
is not a ``SIFT_`` setting. The supervising process calls :func:`setup_multiprocess` once,
before any child starts and before anything is recorded: it empties the directory (stale files
from an earlier run would be counted twice) and switches this process, and every child it forks
or spawns, to file-backed values. When a child exits, call :func:`mark_process_dead` with its
pid (Celery's ``worker_process_shutdown``, gunicorn's ``child_exit``), so its share of the
``live…`` gauges goes away; its counters stay, so no count is lost. Once it is gone (its
supervisor has waited for it), :func:`merge_dead_process` adds its counters and histograms into
one merged file per kind and removes its own, so the files do not pile up over restarts. The
exposition also sweeps the files of pids that no longer exist (both), for children that died
without running the hook.

    setup_multiprocess("/run/sift-metrics")      # supervisor, before forking
    start_worker_metrics_server(9808)             # the Celery main process
    recorder = PrometheusRecorder()               # passed to build_pipeline(recorder=...)
"""

from worker.constants import LANES
from worker.observability.metrics._exposition import (
    exposition_registry,
    metrics_response,
    serve_worker_metrics,
    serve_worker_metrics_when_free,
    snapshot,
    start_worker_metrics_server,
)
from worker.observability.metrics._jobs import (
    INDEX_READ_OPERATIONS,
    INDEX_READS_DROPPED,
    JOB_ERRORS,
    JOB_FAILURES,
    JOB_KINDS,
    JOB_STATES,
    JOB_STATUSES,
    JOBS_COMPLETED,
    JOBS_IN_FLIGHT,
    JOBS_SUBMITTED,
    QUEUE_BACKLOG,
    QUEUE_WAIT,
    QUEUE_WAIT_BUCKETS,
    REDRIVE_KINDS,
    REDRIVEN,
    TASK_DURATION,
    TASK_RETRIES,
    WEBHOOK_DEFERRALS,
    WEBHOOK_DELIVERIES,
    WEBHOOK_EVENTS,
    WEBHOOK_RESULTS,
    RedisLike,
    cancel_counted,
    index_read_dropped,
    job_completed,
    job_store_unread,
    job_submitted,
    observe_queue_wait,
    redriven,
    running_job,
    update_backlog,
    webhook_deferred,
    webhook_delivery,
)
from worker.observability.metrics._multiprocess import (
    MULTIPROC_DIR_ENV,
    SweepingCollector,
    ensure_multiprocess_dir,
    mark_process_dead,
    merge_dead_process,
    multiprocess_dir,
    setup_multiprocess,
    sweep_dead_processes,
)
from worker.observability.metrics._processes import (
    CLOCK_SKEW,
    WORKER_EXIT_CAUSES,
    WORKER_PROCESS_STATES,
    WORKER_PROCESSES,
    WORKER_RESTARTS,
    clock_skew,
    worker_processes,
    worker_restart,
)
from worker.observability.metrics._recorder import PrometheusRecorder
from worker.observability.metrics._recording import OTHER
from worker.observability.metrics._rerank import (
    ATTEMPT_RESULTS,
    BUDGET_UNSETTLED,
    BUDGET_WAIT,
    BUDGET_WAIT_BUCKETS,
    PROVIDER_429,
    PROVIDER_DELETE_RESULTS,
    PROVIDER_DELETES,
    PROVIDER_DELETES_REFUSED,
    PROVIDER_REFUSED_KINDS,
    RERANK_ATTEMPTS,
    RERANK_BUCKETS,
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
    InFlightReranker,
    budget_unsettled,
    budget_waited,
    provider_429,
    provider_batch_delete,
    provider_deletes_refused,
    rerank_in_flight,
)
from worker.observability.metrics._search import (
    CPU_SLOT_WAIT,
    HITS_BUCKETS,
    RETRIEVAL_BUCKETS,
    RETRIEVAL_CHANNELS,
    RETRIEVAL_DURATION,
    RETRIEVAL_HITS,
    SEARCH_BUCKETS,
    SEARCH_DURATION,
    SEARCH_LATENCY_GOAL_SECONDS,
    SEARCH_MODES,
    SEARCH_OUTCOMES,
    SLOT_LINES,
    SLOT_WAIT_BUCKETS,
    slot_waited,
)
from worker.observability.metrics._series import ALL_METRICS, preregister

__all__ = [
    "ALL_METRICS",
    "ATTEMPT_RESULTS",
    "BUDGET_UNSETTLED",
    "BUDGET_WAIT",
    "BUDGET_WAIT_BUCKETS",
    "CLOCK_SKEW",
    "CPU_SLOT_WAIT",
    "HITS_BUCKETS",
    "INDEX_READS_DROPPED",
    "INDEX_READ_OPERATIONS",
    "JOBS_COMPLETED",
    "JOBS_IN_FLIGHT",
    "JOBS_SUBMITTED",
    "JOB_ERRORS",
    "JOB_FAILURES",
    "JOB_KINDS",
    "JOB_STATES",
    "JOB_STATUSES",
    "LANES",
    "MULTIPROC_DIR_ENV",
    "OTHER",
    "PROVIDER_429",
    "PROVIDER_DELETES",
    "PROVIDER_DELETES_REFUSED",
    "PROVIDER_DELETE_RESULTS",
    "PROVIDER_REFUSED_KINDS",
    "QUEUE_BACKLOG",
    "QUEUE_WAIT",
    "QUEUE_WAIT_BUCKETS",
    "REDRIVEN",
    "REDRIVE_KINDS",
    "RERANK_ATTEMPTS",
    "RERANK_BUCKETS",
    "RERANK_COST",
    "RERANK_DURATION",
    "RERANK_DURATION_OUTCOMES",
    "RERANK_IN_FLIGHT",
    "RERANK_OUTCOMES",
    "RERANK_OUTCOME_VALUES",
    "RERANK_TOKENS",
    "RERANK_UNPRICED",
    "RERANK_UNREAD",
    "RERANK_UNREAD_INPUT",
    "RETRIEVAL_BUCKETS",
    "RETRIEVAL_CHANNELS",
    "RETRIEVAL_DURATION",
    "RETRIEVAL_HITS",
    "SEARCH_BUCKETS",
    "SEARCH_DURATION",
    "SEARCH_LATENCY_GOAL_SECONDS",
    "SEARCH_MODES",
    "SEARCH_OUTCOMES",
    "SLOT_LINES",
    "SLOT_WAIT_BUCKETS",
    "TASK_DURATION",
    "TASK_RETRIES",
    "TOKEN_TYPES",
    "WEBHOOK_DEFERRALS",
    "WEBHOOK_DELIVERIES",
    "WEBHOOK_EVENTS",
    "WEBHOOK_RESULTS",
    "WORKER_EXIT_CAUSES",
    "WORKER_PROCESSES",
    "WORKER_PROCESS_STATES",
    "WORKER_RESTARTS",
    "InFlightReranker",
    "PrometheusRecorder",
    "RedisLike",
    "SweepingCollector",
    "budget_unsettled",
    "budget_waited",
    "cancel_counted",
    "clock_skew",
    "ensure_multiprocess_dir",
    "exposition_registry",
    "index_read_dropped",
    "job_completed",
    "job_store_unread",
    "job_submitted",
    "mark_process_dead",
    "merge_dead_process",
    "metrics_response",
    "multiprocess_dir",
    "observe_queue_wait",
    "preregister",
    "provider_429",
    "provider_batch_delete",
    "provider_deletes_refused",
    "redriven",
    "rerank_in_flight",
    "running_job",
    "serve_worker_metrics",
    "serve_worker_metrics_when_free",
    "setup_multiprocess",
    "slot_waited",
    "snapshot",
    "start_worker_metrics_server",
    "sweep_dead_processes",
    "update_backlog",
    "webhook_deferred",
    "webhook_delivery",
    "worker_processes",
    "worker_restart",
]
