"""The Celery settings Sift relies on, from its settings: reliable delivery, time limits,
queues and routes (:func:`celery_config`). No Celery app and no task here: the app
(:mod:`worker.queue.celery_app`) and the tasks (:mod:`worker.queue.tasks`) both build on it.

Concurrency: the worker runs the ``threads`` pool with ``SIFT_WORKER_CONCURRENCY``
threads (300 by default). The pipeline is synchronous and spends its time
waiting on the model (about a second per rerank) or in onnxruntime, apsw and
numpy, which release the GIL, so one process keeps hundreds of searches in
flight. Model calls are further bounded by ``SIFT_RERANK_MAX_IN_FLIGHT``
(:mod:`worker.runtime.ratelimit`). Celery does not enforce ``time_limit`` under the
threads pool; the search deadline, passed down into every stage, is what stops
a search, and the time limits below still apply under ``--pool prefork``.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.entity import Exchange, Queue

from worker.constants import (
    ALL_QUEUES,
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    CANCEL_COUNT_TASK,
    ECONOMY_CANCEL_TASK,
    ECONOMY_DELETE_TASK,
    ECONOMY_POLL_TASK,
    ECONOMY_SUBMIT_TASK,
    INDEX_READ_TASK,
    INGEST_QUEUE,
    INGEST_TASK,
    INGEST_TIME_LIMIT_SECONDS,
    REWRITE_TASK,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.errors import ConfigError
from worker.queue.broker import broker_ssl, broker_transport
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import Settings

# the worker's start-up warning (warn_if_tombstones_too_short) is logged as the app's
log = logging.getLogger("worker.queue.celery_app")

TIME_LIMIT_MARGIN_SECONDS = 15.0  # hard limit = soft limit + this

TASK_ROUTES: dict[str, dict[str, str]] = {
    SEARCH_TASK: {"queue": SEARCH_QUEUE},
    BATCH_CHUNK_TASK: {"queue": BATCH_QUEUE},
    INGEST_TASK: {"queue": INGEST_QUEUE},
    INDEX_READ_TASK: {"queue": SEARCH_QUEUE},
    WEBHOOK_TASK: {"queue": WEBHOOK_QUEUE},
    ECONOMY_SUBMIT_TASK: {"queue": BATCH_QUEUE},
    ECONOMY_POLL_TASK: {"queue": BATCH_QUEUE},
    # a few provider calls, never behind the batch queue's backlog (a cancel delayed there
    # left the provider processing, and billing, what the client had canceled)
    ECONOMY_CANCEL_TASK: {"queue": SEARCH_QUEUE},
    ECONOMY_DELETE_TASK: {"queue": SEARCH_QUEUE},
    CANCEL_COUNT_TASK: {"queue": BATCH_QUEUE},
    REWRITE_TASK: {"queue": SEARCH_QUEUE},
}


# Tries of a publish on a broken broker connection: at once, after 0.5 s, then every second,
# for about the job store's outage window (worker/redis_client.py). A producer that has no
# connection yet waits as long for one (``connect_retries_timeout`` in celery_config).
PUBLISH_RETRY_POLICY: dict[str, float] = {
    "max_retries": int(OUTAGE_SECONDS),
    "interval_start": 0.0,
    "interval_step": 0.5,
    "interval_max": 1.0,
}


def time_limits(settings: Settings) -> dict[str, tuple[float, float]]:
    """(soft, hard) seconds per task, derived from the search deadline and the webhook's cap."""
    search_soft = settings.search_deadline_seconds + 5.0
    chunk_soft = settings.batch_chunk_size * settings.search_deadline_seconds + 5.0
    webhook_soft = webhook_soft_time_limit(settings)
    return {
        SEARCH_TASK: (search_soft, search_soft + TIME_LIMIT_MARGIN_SECONDS),
        BATCH_CHUNK_TASK: (chunk_soft, chunk_soft + TIME_LIMIT_MARGIN_SECONDS),
        INDEX_READ_TASK: (search_soft, search_soft + TIME_LIMIT_MARGIN_SECONDS),
        INGEST_TASK: (INGEST_TIME_LIMIT_SECONDS, INGEST_TIME_LIMIT_SECONDS + 30.0),
        WEBHOOK_TASK: (webhook_soft, webhook_soft + TIME_LIMIT_MARGIN_SECONDS),
    }


def webhook_soft_time_limit(settings: Settings) -> float:
    """The webhook task's soft time limit: one attempt's wall-clock cap
    (SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS), the job store's outage window for its claim and the
    write that records how it ended, and 5 s. A fixed 60 s fired inside the POST of a cap set
    above it (``--pool prefork``): nothing recorded the attempt, and the re-drive sent the
    webhook again every visibility timeout for 7 days."""
    return settings.webhook_total_timeout_seconds + OUTAGE_SECONDS + 5.0


def visibility_timeout(
    settings: Settings, limits: dict[str, tuple[float, float]] | None = None
) -> int:
    """Seconds after which kombu puts back a message still unacked: it must outlast the
    longest task, and an economy poll, which waits up to SIFT_ECONOMY_POLL_MAX_SECONDS as an
    unacked ETA task. A longer wait (a webhook's retry) is made in hops shorter than this."""
    longest_hard = max(hard for _, hard in (limits or time_limits(settings)).values())
    return settings.broker_visibility_timeout_seconds or (
        int(2 * max(longest_hard, settings.economy_poll_max_seconds)) + 60
    )


def ingest_redelivery_window(settings: Settings) -> float:
    """The longest an ingest (or delete) task taken before a later write ran can still
    write: each delivery runs up to the ingest's hard time limit and is given back after
    the visibility timeout (or sooner, by the dead-worker check), up to
    SIFT_TASK_MAX_DELIVERIES times per message; a retry is a new message with a delivery
    budget of its own (the counter is per task id and retry number), so the job has
    1 + SIFT_TASK_MAX_RETRIES such budgets, and each retry waits its capped backoff. A
    delete's tombstone (Elasticsearch's ``index.gc_deletes``, the embedded backend's
    ``tombstone_seconds``) must outlast it. (Not
    counted: a re-drive of a message the broker lost, :mod:`worker.queue.redrive`; nor a run
    past the hard limit, which only ``--pool prefork`` enforces, not the default threads.)"""
    from worker.queue.base import RETRY_CAP_SECONDS

    _soft, hard = time_limits(settings)[INGEST_TASK]
    messages = settings.task_max_retries + 1
    deliveries = messages * settings.task_max_deliveries * (visibility_timeout(settings) + hard)
    return deliveries + settings.task_max_retries * RETRY_CAP_SECONDS


def warn_if_tombstones_too_short(settings: Settings) -> bool:
    """Warn (and answer True) if the backend would forget a delete's tombstone before an
    ingest accepted before the delete can no longer run: that ingest would write back
    documents the delete took (raise SIFT_ELASTICSEARCH_GC_DELETES_SECONDS, which is how long
    either backend keeps one: Elasticsearch's ``index.gc_deletes``, the embedded backend's
    ``tombstone_seconds``)."""
    window = ingest_redelivery_window(settings)
    if settings.elasticsearch_gc_deletes_seconds >= window:
        return False
    log.warning(
        "SIFT_ELASTICSEARCH_GC_DELETES_SECONDS=%d is shorter than the ingest redelivery "
        "window (%.0f s at these settings): an ingest redelivered after a later delete of "
        "the same id may write it back; raise it to at least %.0f",
        settings.elasticsearch_gc_deletes_seconds,
        window,
        window,
    )
    return True


def celery_config(settings: Settings) -> dict[str, Any]:
    """Every Celery setting Sift relies on, in one place."""
    if not settings.redis_url:
        raise ConfigError("SIFT_REDIS_URL is required to run the queue")
    limits = time_limits(settings)
    visibility = visibility_timeout(settings, limits)
    return {
        "broker_url": settings.redis_url,
        # kombu's Redis transport with a fix that keeps the worker alive when Redis restarts
        # (redis:// and rediss://)
        "broker_transport": broker_transport(settings.redis_url),
        # rediss://: the certificate checked as the job store's redis-py checks it, from the URL
        "broker_use_ssl": broker_ssl(settings.redis_url),
        "result_backend": None,  # results live in the job store, not in Celery
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # a message a task sends (a webhook, a retry) rides out a Redis restart as the job
        # store does: Celery's default gives up after 3 tries in 0.6 s, and the task failed
        # with its job final and its webhook never enqueued
        "task_publish_retry_policy": PUBLISH_RETRY_POLICY,
        "worker_prefetch_multiplier": 1,
        "worker_pool": settings.worker_pool,
        # prefork with the threads pool's 300 left unset (`sift worker` refuses it; `celery
        # worker` run by hand forked 300 children): Celery's own default, a child a core
        "worker_concurrency": settings.worker_concurrency
        if settings.worker_pool == "threads" or "worker_concurrency" in settings.model_fields_set
        else None,
        # cancelling means killing the job, which only prefork can do: the threads pool raises
        # NotImplementedError (kill_job) mid-reconnect. Its tasks keep running; their messages
        # stay unacked and come back after the visibility timeout if the worker dies.
        "worker_cancel_long_running_tasks_on_connection_loss": settings.worker_pool == "prefork",
        "worker_soft_shutdown_timeout": settings.worker_soft_shutdown_seconds,
        "worker_enable_soft_shutdown_on_idle": True,
        "broker_connection_retry_on_startup": True,
        # an unacked message comes back after this; it must outlast the longest task.
        # kombu sweeps for such messages every interval x throttle seconds: at most 10 s here
        "broker_transport_options": {
            "visibility_timeout": visibility,
            "unacked_restore_interval": max(1, min(10, visibility // 10)),
            "unacked_restore_throttle": 1,
            # a worker killed during its sweep leaves the sweep's lock behind: held this long
            # (kombu's default, 300 s, would stall a short timeout's recovery for 5 minutes)
            "unacked_mutex_expire": min(300, visibility),
            # a publish on a producer that has no connection yet (the pool makes one for
            # each publisher at once) connects for as long as task_publish_retry_policy
            # retries one that broke; kombu's default, the 4 s connect timeout, failed it
            "connect_retries_timeout": OUTAGE_SECONDS,
        },
        # one direct exchange per queue, named like it: what send_task(queue=...) creates on
        # the gateway's side too. A shared exchange and key would copy a message into every queue.
        "task_queues": [
            Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]
            for name in ALL_QUEUES
        ],
        "task_default_queue": SEARCH_QUEUE,
        "task_routes": TASK_ROUTES,
        "task_annotations": {
            name: {"soft_time_limit": soft, "time_limit": hard}
            for name, (soft, hard) in limits.items()
        },
        "task_create_missing_queues": False,
    }
