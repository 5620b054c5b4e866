"""Sift's Prometheus metrics: each DESIGN.md §9 metric defined once, the recorder, the exposition.

This module depends on ``prometheus_client`` and :mod:`worker.constants` only, so the gateway
can import it without the search core.

Who calls what:

* the pipeline reports through :class:`PrometheusRecorder` (the ``Recorder`` port);
* a Celery task calls :func:`observe_queue_wait`, :func:`job_completed` and
  :func:`running_job`; the webhook task calls :func:`webhook_delivery`;
* the gateway calls :func:`job_submitted`, mounts :func:`metrics_asgi_app` at ``/metrics``,
  and may call :func:`update_backlog` from a periodic loop;
* a worker's main process calls :func:`start_worker_metrics_server`.

Multiprocess mode. Where a process forks (Celery prefork, several gateway workers) each
process writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` and the exposition sums
them. That variable is prometheus-client's own (as ``ANTHROPIC_BASE_URL`` is the SDK's), so it
is not a ``SIFT_`` setting. The supervising process calls :func:`setup_multiprocess` once,
before any child starts and before anything is recorded: it empties the directory (stale files
from an earlier run would be counted twice) and switches this process, and every child it forks
or spawns, to file-backed values. When a child exits, call :func:`mark_process_dead` with its
pid (Celery's ``worker_process_shutdown``, gunicorn's ``child_exit``), so its share of the
``live…`` gauges goes away; its counters stay, so no count is lost. The exposition also sweeps
the files of pids that no longer exist, for children that died without running the hook.

    setup_multiprocess("/run/sift-metrics")      # supervisor, before forking
    start_worker_metrics_server(9808)             # the Celery main process
    recorder = PrometheusRecorder()               # passed to build_pipeline(recorder=...)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from threading import Thread
from typing import TYPE_CHECKING, Any, Final, ParamSpec, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_asgi_app,
    start_http_server,
)
from prometheus_client import values as _prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.multiprocess import mark_process_dead as _mark_process_dead
from prometheus_client.registry import Collector

from worker.constants import (
    METRIC_JOB_FAILURES,
    METRIC_JOBS_COMPLETED,
    METRIC_JOBS_IN_FLIGHT,
    METRIC_JOBS_SUBMITTED,
    METRIC_PROVIDER_429,
    METRIC_QUEUE_BACKLOG,
    METRIC_QUEUE_WAIT,
    METRIC_RATE_BUDGET_WAIT,
    METRIC_REDRIVEN,
    METRIC_RERANK_ATTEMPTS,
    METRIC_RERANK_COST,
    METRIC_RERANK_DURATION,
    METRIC_RERANK_IN_FLIGHT,
    METRIC_RERANK_OUTCOMES,
    METRIC_RERANK_TOKENS,
    METRIC_RERANK_UNPRICED,
    METRIC_RETRIEVAL_DURATION,
    METRIC_RETRIEVAL_HITS,
    METRIC_SEARCH_DURATION,
    METRIC_TASK_DURATION,
    METRIC_TASK_RETRIES,
    METRIC_WEBHOOK_DELIVERIES,
    POLICY_ID,
    kombu_queue_keys,
)

if TYPE_CHECKING:
    from worker.core.ports import Reranker
    from worker.core.types import RerankPrompt, RerankReply

log = logging.getLogger(__name__)

MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's own variable: when set, values live in files there (multiprocess mode)."""

# --- closed label sets (DESIGN.md §9: never a job id, a tenant or query text) ---------------
OTHER: Final = (
    "other"  # what an unexpected label value is recorded as, so cardinality stays bounded
)
SEARCH_MODES: Final = ("fts", "vector", "hybrid")
SEARCH_OUTCOMES: Final = ("ok", "fallback", "error")
RETRIEVAL_CHANNELS: Final = ("bm25", "knn", "embed", "fuse")  # embed, fuse: Sift's own stages
ATTEMPT_RESULTS: Final = (
    "ok",
    "timeout",
    "http_5xx",
    "rate_limited",
    "connection",
    "http_4xx",
    "malformed",
    "budget_exhausted",  # not sent: the shared rate budget would free it past the deadline
)
RERANK_DURATION_OUTCOMES: Final = (*ATTEMPT_RESULTS, "deadline")  # the last attempt's class
RERANK_OUTCOME_VALUES: Final = (
    "applied",
    "fallback_no_valid_ranks",
    "fallback_error",
    "failed",
    "skipped",
)
TOKEN_TYPES: Final = ("input", "output", "cache_read", "cache_creation")
LANES: Final = ("standard", "economy")
JOB_STATES: Final = ("queued", "running")
# no "webhook": a delivery is sift_webhook_deliveries_total's, and a kind="webhook" job series,
# counted by nothing, read 0 submitted and 0 completed while webhooks went out
JOB_KINDS: Final = ("search", "batch", "batch_item", "ingest")
JOB_STATUSES: Final = ("succeeded", "failed", "canceled")
# a failed job's ``error.type``, exactly: the SiftError.code values (worker/errors.py), and the
# three a record gets otherwise (worker/queue/base.py's error_info, worker/queue/tasks.py). The
# label was "internal" for those three: a crash loop's jobs, expired documents and a bug in one
JOB_ERRORS: Final = (
    "invalid_request",
    "config_error",
    "mode_unavailable",
    "index_not_found",
    "embedding_model_mismatch",
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
REDRIVE_KINDS: Final = ("search", "batch", "ingest", "economy", "webhook")

# --- buckets -------------------------------------------------------------------------------
SEARCH_LATENCY_GOAL_SECONDS: Final = 2.5
"""The interactive search latency goal; ``sift_search_duration_seconds`` has a bucket at it."""
SEARCH_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# A standard-lane rerank takes 0.25-60 s (its deadline is 30 s). An economy-lane one is timed
# from the provider batch's submission to its answer: at least a poll (30 s), typically minutes,
# up to the economy deadline (a day); without the long buckets all of it fell in +Inf and every
# percentile of the lane read 60 s.
RERANK_BUCKETS: Final = (
    0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0,
)  # fmt: skip
# The embedded backend answers a channel in milliseconds; Elasticsearch over the network in
# tens to hundreds, and seconds when it is slow (the search deadline is 30 s): those must not
# all read as +Inf.
RETRIEVAL_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# hits one channel returned for one search (its window is max(4 * coarse limit, 32): 120 at
# the defaults), or the candidates fusion kept (the coarse limit); 0 is an empty channel
HITS_BUCKETS: Final = (0, 1, 5, 10, 20, 32, 50, 100, 120, 250, 500, 1000, 2500, 10000)
QUEUE_WAIT_BUCKETS: Final = (
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0,
)  # fmt: skip
# a call's wait for the shared rate budget: none at all, up to the longest pause (a minute)
BUDGET_WAIT_BUCKETS: Final = (
    0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip

# --- the metrics, each defined once ----------------------------------------------------------
# Every metric has labels, so no value exists until the first ``labels()`` call: that is what
# lets setup_multiprocess() switch to file-backed values after this module is imported.

SEARCH_DURATION = Histogram(
    METRIC_SEARCH_DURATION,
    "Seconds for one search, retrieval to final hits, by mode and outcome (ok, fallback, "
    "error); an economy-lane search's own work, without the provider batch's wait (that is "
    'sift_rerank_duration_seconds{lane="economy"}).',
    ["mode", "outcome"],
    buckets=SEARCH_BUCKETS,
)
QUEUE_WAIT = Histogram(
    METRIC_QUEUE_WAIT,
    "Seconds from a job's submission to a worker starting it, by queue; a webhook attempt: "
    "from when it was due (its job's end, or its retry's time) to its run.",
    ["queue"],
    buckets=QUEUE_WAIT_BUCKETS,
)
RETRIEVAL_DURATION = Histogram(
    METRIC_RETRIEVAL_DURATION,
    "Seconds one backend spent on one channel of one search (embed: the query embedding; "
    "fuse: admission and fusion of the channels' hits).",
    ["backend", "channel"],
    buckets=RETRIEVAL_BUCKETS,
)
RETRIEVAL_HITS = Histogram(
    METRIC_RETRIEVAL_HITS,
    "Hits one channel of one search returned (bm25, knn), and the candidates fusion kept "
    'of them (fuse); an empty channel is the le="0" bucket.',
    ["backend", "channel"],
    buckets=HITS_BUCKETS,
)
RERANK_DURATION = Histogram(
    METRIC_RERANK_DURATION,
    "Seconds for the whole rerank of one search, every attempt and backoff included; in the "
    "economy lane, from the first provider batch submission to the answer.",
    ["model", "outcome", "lane"],
    buckets=RERANK_BUCKETS,
)
RERANK_TOKENS = Counter(
    METRIC_RERANK_TOKENS,
    "Tokens the provider reported, by disjoint type: their sum is what is billed.",
    ["model", "type", "lane"],
)
RERANK_ATTEMPTS = Counter(
    METRIC_RERANK_ATTEMPTS,
    "Model calls, by the one class each attempt falls in.",
    ["model", "result"],
)
RERANK_OUTCOMES = Counter(
    METRIC_RERANK_OUTCOMES,
    "Searches that asked for a rerank, by what became of it.",
    ["policy", "outcome"],
)
RERANK_COST = Counter(
    METRIC_RERANK_COST,
    "Estimated US dollars for rerank calls: the provider's usage times SIFT_PRICES.",
    ["model", "lane"],
)
RERANK_UNPRICED = Counter(
    METRIC_RERANK_UNPRICED,
    "Model calls that reported usage for a model with no price in SIFT_PRICES: their cost is "
    "unknown (null in the job's usage) and missing from the cost counter.",
    ["model", "lane"],
)
RERANK_IN_FLIGHT = Gauge(
    METRIC_RERANK_IN_FLIGHT,
    "Model calls waiting for the provider right now.",
    ["model"],
    multiprocess_mode="livesum",
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
# The shared rate budget's metrics (extensions to §9; worker/adapters/rate_budget.py).
BUDGET_WAIT = Histogram(
    METRIC_RATE_BUDGET_WAIT,
    "Seconds a model call waited for the shared rate budget before it was sent (0: none), "
    "by model and lane; a call the budget could not serve in time is not observed here but "
    "counted as a budget_exhausted attempt.",
    ["model", "lane"],
    buckets=BUDGET_WAIT_BUCKETS,
)
PROVIDER_429 = Counter(
    METRIC_PROVIDER_429,
    "HTTP 429 (rate limited) answers of the model provider, by model and lane: each paused "
    "every worker process for its retry-after.",
    ["model", "lane"],
)

ALL_METRICS: Final[tuple[Counter | Gauge | Histogram, ...]] = (
    SEARCH_DURATION,
    QUEUE_WAIT,
    RETRIEVAL_DURATION,
    RETRIEVAL_HITS,
    RERANK_DURATION,
    RERANK_TOKENS,
    RERANK_ATTEMPTS,
    RERANK_OUTCOMES,
    RERANK_COST,
    RERANK_UNPRICED,
    RERANK_IN_FLIGHT,
    JOBS_IN_FLIGHT,
    WEBHOOK_DELIVERIES,
    QUEUE_BACKLOG,
    JOBS_SUBMITTED,
    JOBS_COMPLETED,
    JOB_FAILURES,
    REDRIVEN,
    TASK_DURATION,
    TASK_RETRIES,
    BUDGET_WAIT,
    PROVIDER_429,
)

P = ParamSpec("P")


def _never_raises(method: Callable[P, None]) -> Callable[P, None]:
    """Metrics must not break a search: log what went wrong and carry on."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            log.exception("recording a metric failed in %s", method.__qualname__)

    return wrapper


_children: dict[tuple[object, tuple[str, ...]], Any] = {}


def _child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, kept after its first call. prometheus-client checks the
    values and takes its lock at every ``labels`` (a search makes some fifteen such calls, a
    tenth of the pipeline's own CPU); the child it answers is the same object every time,
    since nothing here removes one, so the kept one is the one it would answer."""
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


_warned: set[tuple[str, str]] = set()


def _closed(value: str, allowed: Sequence[str], label: str) -> str:
    """``value`` if it belongs to the label's closed set, else ``other`` (warned once)."""
    if value in allowed:
        return value
    if (label, value) not in _warned:
        _warned.add((label, value))
        log.warning("unexpected %s label value %r recorded as %r", label, value, OTHER)
    return OTHER


# --- the Recorder port's adapter -------------------------------------------------------------


class PrometheusRecorder:
    """The ``Recorder`` port in Prometheus metrics. ``lane`` labels tokens, cost and the rerank
    duration (an economy rerank waits minutes to hours on the provider's batch).

    >>> build_pipeline(settings, recorder=PrometheusRecorder())  # doctest: +SKIP
    """

    def __init__(self, lane: str = "standard") -> None:
        self.lane = _closed(lane, LANES, "lane")

    @_never_raises
    def retrieval(self, backend: str, channel: str, seconds: float) -> None:
        channel = _closed(channel, RETRIEVAL_CHANNELS, "channel")
        _child(RETRIEVAL_DURATION, backend, channel).observe(seconds)

    @_never_raises
    def retrieval_hits(self, backend: str, channel: str, hits: int) -> None:
        channel = _closed(channel, RETRIEVAL_CHANNELS, "channel")
        _child(RETRIEVAL_HITS, backend, channel).observe(hits)

    @_never_raises
    def rerank_attempt(self, model: str, result: str) -> None:
        _child(RERANK_ATTEMPTS, model, _closed(result, ATTEMPT_RESULTS, "result")).inc()

    @_never_raises
    def rerank_usage(self, model: str, usage: dict[str, int], cost_usd: float | None) -> None:
        for token_type in TOKEN_TYPES:
            tokens = usage.get(token_type, 0)
            if tokens:
                _child(RERANK_TOKENS, model, token_type, self.lane).inc(tokens)
        if cost_usd:  # None (no price) adds nothing: rerank_unpriced counted those calls
            _child(RERANK_COST, model, self.lane).inc(cost_usd)

    @_never_raises
    def rerank_done(self, model: str, outcome: str, seconds: float) -> None:
        outcome = _closed(outcome, RERANK_DURATION_OUTCOMES, "outcome")
        _child(RERANK_DURATION, model, outcome, self.lane).observe(seconds)

    @_never_raises
    def rerank_unpriced(self, model: str) -> None:
        RERANK_UNPRICED.labels(model, self.lane).inc()

    @_never_raises
    def rerank_outcome(self, policy: str, outcome: str) -> None:
        _child(RERANK_OUTCOMES, policy, _closed(outcome, RERANK_OUTCOME_VALUES, "outcome")).inc()

    @_never_raises
    def search_done(self, mode: str, outcome: str, seconds: float) -> None:
        mode = _closed(mode, SEARCH_MODES, "mode")
        outcome = _closed(outcome, SEARCH_OUTCOMES, "outcome")
        _child(SEARCH_DURATION, mode, outcome).observe(seconds)


@contextlib.contextmanager
def rerank_in_flight(model: str) -> Iterator[None]:
    """Counts one model call in ``sift_rerank_in_flight`` while the block runs."""
    gauge = _child(RERANK_IN_FLIGHT, model)
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


class InFlightReranker:
    """Wraps a ``Reranker`` so each call shows in ``sift_rerank_in_flight``.

    >>> reranker = InFlightReranker(AnthropicReranker("claude-haiku-4-5"))  # doctest: +SKIP
    """

    def __init__(self, inner: Reranker) -> None:
        self.inner = inner
        self.model = inner.model

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        with rerank_in_flight(self.model):
            try:
                return self.inner.rerank(prompt, timeout_seconds)
            except Exception as exc:
                # only the model adapter is inside: a rate_limited attempt here is a real 429
                # (AttemptOutcome is a StrEnum; compared by value, this module imports no core)
                if getattr(exc, "outcome", None) == "rate_limited":
                    provider_429(self.model)
                raise


# --- helpers for the tasks and the gateway ---------------------------------------------------


@_never_raises
def budget_waited(model: str, lane: str, seconds: float) -> None:
    """A model call of ``lane`` waited ``seconds`` for the shared rate budget (0: none)."""
    _child(BUDGET_WAIT, model, _closed(lane, LANES, "lane")).observe(max(0.0, seconds))


@_never_raises
def provider_429(model: str, lane: str = "standard") -> None:
    """The model provider answered a call of ``lane`` with HTTP 429."""
    PROVIDER_429.labels(model, _closed(lane, LANES, "lane")).inc()


@_never_raises
def observe_queue_wait(queue: str, seconds: float) -> None:
    """A worker started a job ``seconds`` after it was submitted to ``queue``."""
    _child(QUEUE_WAIT, queue).observe(max(0.0, seconds))


@_never_raises
def job_submitted(kind: str, count: int = 1) -> None:
    """The gateway accepted ``count`` jobs of ``kind`` (a batch adds one per item)."""
    JOBS_SUBMITTED.labels(_closed(kind, JOB_KINDS, "kind")).inc(count)


@_never_raises
def job_completed(kind: str, status: str, error: str | None = None, count: int = 1) -> None:
    """``count`` jobs reached a final status; a failed one also counts under its error class."""
    kind = _closed(kind, JOB_KINDS, "kind")
    _child(JOBS_COMPLETED, kind, _closed(status, JOB_STATUSES, "status")).inc(count)
    if status == "failed":
        label = _closed(error or "internal_error", JOB_ERRORS, "error")
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
    gauge = _child(JOBS_IN_FLIGHT, "running")
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


@_never_raises
def redriven(kind: str, count: int = 1) -> None:
    """The re-drive enqueued ``count`` lost task messages of a job of ``kind`` again."""
    REDRIVEN.labels(_closed(kind, REDRIVE_KINDS, "kind")).inc(count)


@_never_raises
def webhook_delivery(result: str) -> None:
    """One webhook delivery attempt ended with ``result``: delivered, retry or failed."""
    WEBHOOK_DELIVERIES.labels(_closed(result, WEBHOOK_RESULTS, "result")).inc()


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


def preregister(
    models: Iterable[str] = (),
    backend: str | None = None,
    queues: Iterable[str] = (),
    lanes: Iterable[str] = LANES,
) -> None:
    """Create the known series at zero, so dashboards and rates see them before the first event.

    Call it once at start-up, in the supervising process in multiprocess mode.
    """
    for model in models:
        for result in ATTEMPT_RESULTS:
            RERANK_ATTEMPTS.labels(model, result)
        for lane in lanes:
            for outcome in RERANK_DURATION_OUTCOMES:
                RERANK_DURATION.labels(model, outcome, lane)
            for token_type in TOKEN_TYPES:
                RERANK_TOKENS.labels(model, token_type, lane)
            RERANK_COST.labels(model, lane)
            RERANK_UNPRICED.labels(model, lane)
            BUDGET_WAIT.labels(model, lane)
            PROVIDER_429.labels(model, lane)
        RERANK_IN_FLIGHT.labels(model).set(0)
    for outcome in RERANK_OUTCOME_VALUES:
        RERANK_OUTCOMES.labels(POLICY_ID, outcome)
    for mode in SEARCH_MODES:
        for outcome in SEARCH_OUTCOMES:
            SEARCH_DURATION.labels(mode, outcome)
    if backend is not None:
        for channel in RETRIEVAL_CHANNELS:
            RETRIEVAL_DURATION.labels(backend, channel)
            if channel != "embed":
                RETRIEVAL_HITS.labels(backend, channel)
    for queue in queues:
        QUEUE_WAIT.labels(queue)
    for kind in JOB_KINDS:
        JOBS_SUBMITTED.labels(kind)
        for status in JOB_STATUSES:
            JOBS_COMPLETED.labels(kind, status)
        for error in JOB_ERRORS:
            JOB_FAILURES.labels(kind, error)
    JOBS_IN_FLIGHT.labels("running").set(0)  # "queued" is the job store's to report
    for result in WEBHOOK_RESULTS:
        WEBHOOK_DELIVERIES.labels(result)
    for kind in REDRIVE_KINDS:
        REDRIVEN.labels(kind)


# --- multiprocess mode -------------------------------------------------------------------------


def multiprocess_dir() -> str | None:
    """The directory of multiprocess mode, or None in single-process mode."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def ensure_multiprocess_dir() -> None:
    """Make the folder ``PROMETHEUS_MULTIPROC_DIR`` names, if it is set and missing, before the
    first value is written there (prometheus-client opens its files in it and does not make it).

    For a process that keeps others' files (the gateway): it empties nothing. deploy/k8s mounts
    an ``emptyDir`` at ``/tmp``, which hides the ``/tmp/sift-metrics`` the image made."""
    directory = multiprocess_dir()
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)


def setup_multiprocess(directory: str | os.PathLike[str]) -> Path:
    """Switch to multiprocess mode with a clean ``directory``, once, before forking: in the
    supervisor of worker processes, or in a worker run as one process (``sift worker``).

    Empties the directory of value files from an earlier run, exports
    ``PROMETHEUS_MULTIPROC_DIR`` for the children, and switches this process to file-backed
    values. Raises RuntimeError if a metric has already been recorded in this process.
    """
    recorded = [m for m in ALL_METRICS if getattr(m, "_metrics", None)]
    if recorded:
        names = ", ".join(sorted(m._name for m in recorded))
        raise RuntimeError(f"setup_multiprocess() must run before anything is recorded: {names}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _warn_if_shared(path)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_DIR_ENV] = str(path)
    # prometheus-client picks its value class once, when first imported; pick again now that
    # the directory is known, so values created from here on go to files.
    _prometheus_values.ValueClass = _prometheus_values.get_value_class()  # type: ignore[no-untyped-call]
    return path


def _warn_if_shared(path: Path) -> None:
    """Say so when ``path`` holds files of another process still running: it shares the
    folder (two ``sift worker``, or a worker and a gateway, given one
    ``PROMETHEUS_MULTIPROC_DIR``). Emptying it takes that process's values from its
    ``/metrics`` for good, and while both write there each serves the other's too. A warning,
    not a refusal: the pid may be an unrelated process that reused a dead writer's number."""
    pids = {int(m.group(1)) for f in path.glob("*.db") if (m := _VALUE_FILE.match(f.name))}
    live = sorted(pid for pid in pids if pid != os.getpid() and _alive(pid))
    if live:
        log.warning(
            "PROMETHEUS_MULTIPROC_DIR %s holds the metrics files of running pid(s) %s: give each "
            "sift worker and gateway a folder of its own; emptying it now",
            path,
            ", ".join(map(str, live)),
        )


def mark_process_dead(pid: int) -> None:
    """A child process exited: drop its share of the live gauges (its counters stay).

    Celery: ``worker_process_shutdown.connect(lambda pid=None, **_: mark_process_dead(pid))``.
    gunicorn: ``def child_exit(server, worker): mark_process_dead(worker.pid)``.
    """
    directory = multiprocess_dir()
    if directory is not None:
        _mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")
_VALUE_FILE = re.compile(r"^[a-z_]+_(\d+)\.db$")  # counter_12.db, gauge_livesum_12.db, ...


def sweep_dead_processes(directory: str | os.PathLike[str]) -> list[int]:
    """Mark dead every pid whose live-gauge files remain but whose process is gone."""
    pids = set()
    for path in Path(directory).glob("gauge_live*_*.db"):
        match = _LIVE_GAUGE_FILE.match(path.name)
        if match:
            pids.add(int(match.group(1)))
    dead = [pid for pid in sorted(pids) if not _alive(pid)]
    for pid in dead:
        _mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    return dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SweepingCollector(MultiProcessCollector):
    """Sums every process's files, after forgetting the live gauges of dead processes.

    A file a starting process has just created is still empty (prometheus-client sizes it
    and writes its header a moment later): it is left out of this collection rather than
    failing the whole scrape (``struct.error``), as ``MultiProcessCollector`` would.
    """

    def collect(self) -> Any:
        sweep_dead_processes(self._path)
        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _has_header(f)]
        return self.merge(files, accumulate=True)  # type: ignore[no-untyped-call]


def _has_header(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8  # the used-bytes word and its padding
    except OSError:  # removed meanwhile (a dead process's live gauge)
        return False


# --- exposition -------------------------------------------------------------------------------


def exposition_registry() -> Collector:
    """What ``/metrics`` serves: every process summed in multiprocess mode, else this one."""
    directory = multiprocess_dir()
    if directory is None:
        return REGISTRY
    registry = CollectorRegistry()
    SweepingCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return registry


def metrics_response() -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answer, for any web framework."""
    return generate_latest(exposition_registry()), CONTENT_TYPE_LATEST


def metrics_asgi_app() -> Callable[..., Any]:
    """An ASGI app serving ``/metrics``; mount it after :func:`setup_multiprocess`, if used.

    >>> app.mount("/metrics", metrics_asgi_app())  # doctest: +SKIP
    """
    return make_asgi_app(registry=exposition_registry())


def start_worker_metrics_server(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, Thread]:
    """Serve ``/metrics`` on ``port`` (``SIFT_WORKER_METRICS_PORT``) from a daemon thread.

    Call it in the worker's main process (Celery ``worker_init``), never in a prefork child.
    Port 0 picks a free port: read it from ``server.server_address[1]``.
    """
    server, thread = start_http_server(port, addr, registry=exposition_registry())
    return server, thread


def snapshot(
    registry: Collector | None = None,
) -> Mapping[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition as ``{(name, sorted labels): value}``, for tests and tools."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in (registry or exposition_registry()).collect():
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out
