"""The Celery app, built from the settings: reliable delivery, time limits, queues and routes.

``celery -A worker.queue.celery_app worker`` finds ``app`` here; it is built on first
access (PEP 562), so importing this module does no work.

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
import os
import threading
import time
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    task_received,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu.entity import Exchange, Queue

from worker.constants import (
    ALL_QUEUES,
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    CANCEL_COUNT_TASK,
    ECONOMY_CANCEL_TASK,
    ECONOMY_POLL_TASK,
    ECONOMY_SUBMIT_TASK,
    INDEX_READ_TASK,
    INGEST_QUEUE,
    INGEST_TASK,
    INGEST_TIME_LIMIT_SECONDS,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.errors import ConfigError
from worker.queue.broker import broker_transport
from worker.queue.intake import IntakeStep
from worker.queue.redrive import ReconnectStep
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import Settings, load_settings

log = logging.getLogger(__name__)

# How long a stopping worker waits for its warm-up (seconds): making the int8 graph takes a
# few, loading the model about one
WARM_UP_STOP_WAIT_SECONDS = 30.0
_warming: threading.Thread | None = None  # this process's warm-up (see _warm_up)

TIME_LIMIT_MARGIN_SECONDS = 15.0  # hard limit = soft limit + this
WEBHOOK_TIME_LIMIT_SECONDS = 60.0

TASK_ROUTES: dict[str, dict[str, str]] = {
    SEARCH_TASK: {"queue": SEARCH_QUEUE},
    BATCH_CHUNK_TASK: {"queue": BATCH_QUEUE},
    INGEST_TASK: {"queue": INGEST_QUEUE},
    INDEX_READ_TASK: {"queue": SEARCH_QUEUE},
    WEBHOOK_TASK: {"queue": WEBHOOK_QUEUE},
    ECONOMY_SUBMIT_TASK: {"queue": BATCH_QUEUE},
    ECONOMY_POLL_TASK: {"queue": BATCH_QUEUE},
    ECONOMY_CANCEL_TASK: {"queue": BATCH_QUEUE},
    CANCEL_COUNT_TASK: {"queue": BATCH_QUEUE},
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
    """(soft, hard) seconds per task, derived from the search deadline."""
    search_soft = settings.search_deadline_seconds + 5.0
    chunk_soft = settings.batch_chunk_size * settings.search_deadline_seconds + 5.0
    return {
        SEARCH_TASK: (search_soft, search_soft + TIME_LIMIT_MARGIN_SECONDS),
        BATCH_CHUNK_TASK: (chunk_soft, chunk_soft + TIME_LIMIT_MARGIN_SECONDS),
        INDEX_READ_TASK: (search_soft, search_soft + TIME_LIMIT_MARGIN_SECONDS),
        INGEST_TASK: (INGEST_TIME_LIMIT_SECONDS, INGEST_TIME_LIMIT_SECONDS + 30.0),
        WEBHOOK_TASK: (WEBHOOK_TIME_LIMIT_SECONDS, WEBHOOK_TIME_LIMIT_SECONDS + 15.0),
    }


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
    delete's tombstone on Elasticsearch (``index.gc_deletes``) must outlast it. (Not
    counted: a re-drive of a message the broker lost, :mod:`worker.queue.redrive`; nor a run
    past the hard limit, which only ``--pool prefork`` enforces, not the default threads.)"""
    from worker.queue.base import RETRY_CAP_SECONDS

    _soft, hard = time_limits(settings)[INGEST_TASK]
    messages = settings.task_max_retries + 1
    deliveries = messages * settings.task_max_deliveries * (visibility_timeout(settings) + hard)
    return deliveries + settings.task_max_retries * RETRY_CAP_SECONDS


def warn_if_tombstones_too_short(settings: Settings) -> bool:
    """Warn (and answer True) if Elasticsearch would forget a delete's tombstone before an
    ingest accepted before the delete can no longer run: that ingest would write back
    documents the delete took (raise SIFT_ELASTICSEARCH_GC_DELETES_SECONDS)."""
    window = ingest_redelivery_window(settings)
    if settings.search_backend != "elasticsearch":
        return False
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
        "broker_transport": broker_transport(settings.redis_url),
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
        "worker_concurrency": settings.worker_concurrency,
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


def _serve_metrics(sender: Any = None, **_: Any) -> None:
    """On worker start, serve ``/metrics`` on ``SIFT_WORKER_METRICS_PORT`` (0 turns it off)."""
    app = getattr(sender, "app", None)
    settings: Settings | None = getattr(getattr(app, "conf", None), "sift_settings", None)
    if settings is None or not settings.worker_metrics_port:
        return
    from worker.observability.metrics import preregister, start_worker_metrics_server

    # the model's and the backend's series too, at zero: a rate or an increase over a series
    # that first appears at its first event would miss that event
    models = [settings.generation_model_id] if settings.generation_model_id else []
    preregister(
        models=models,
        backend=settings.search_backend,
        queues=ALL_QUEUES,
        native_fusion=settings.native_fusion,
    )
    try:
        start_worker_metrics_server(settings.worker_metrics_port)
    except OSError as exc:
        log.warning("worker metrics not served on :%d: %s", settings.worker_metrics_port, exc)
    else:
        log.info("worker metrics on :%d/metrics", settings.worker_metrics_port)


def _check_prices(sender: Any = None, **_: Any) -> None:
    """On worker start (ready: its logging is set up by then), warn if the generation model
    has no price (worker/runtime/bootstrap.py), or if Elasticsearch's tombstones would not outlast
    an ingest's redelivery (:func:`warn_if_tombstones_too_short`)."""
    settings = getattr(getattr(getattr(sender, "app", None), "conf", None), "sift_settings", None)
    if settings is not None:
        from worker.runtime.bootstrap import warn_if_unpriced

        warn_if_unpriced(settings)
        warn_if_tombstones_too_short(settings)


def _warm_up(sender: Any = None, **_: Any) -> None:
    """On worker start (ready), build this process's runtime and embed one text, on a thread
    of its own: the first search or ingest paid for it (the model session's load, about a
    second; on a machine's first start also the int8 graph's making, a few more). Only a
    threads-pool worker that takes searches, batches or ingests: a prefork parent never runs
    them, and a webhooks-only worker never embeds."""
    app = getattr(sender, "app", None)
    settings: Settings | None = getattr(getattr(app, "conf", None), "sift_settings", None)
    if settings is None or not settings.redis_url or settings.worker_pool != "threads":
        return
    consumed = set(app.amqp.queues.consume_from)  # type: ignore[union-attr]
    if not consumed & {SEARCH_QUEUE, BATCH_QUEUE, INGEST_QUEUE}:
        return
    from worker.queue.base import warm_up

    global _warming
    _warming = threading.Thread(target=warm_up, args=(settings,), name="sift-warm-up", daemon=True)
    _warming.start()


def _warm_up_ends(**_: Any) -> None:
    """On worker stop, let a warm-up still running end first (up to WARM_UP_STOP_WAIT_SECONDS,
    or until Ctrl-C again): dropped at exit half-way through the int8 graph, its seconds were
    lost, and the clean-up of its work folder ran beside it still writing there (a
    traceback, the folder left)."""
    from celery.worker import state

    if _warming is None or not _warming.is_alive():
        return
    log.info("waiting for the warm-up to end (the embedding model's load) before exiting")
    deadline = time.monotonic() + WARM_UP_STOP_WAIT_SECONDS
    # Ctrl-C again (Celery's cold stop: it only sets should_terminate) leaves at once
    while _warming.is_alive() and time.monotonic() < deadline:
        if state.should_terminate is not None and state.should_terminate is not False:
            return
        _warming.join(0.1)


def _start_redrive(sender: Any = None, **_: Any) -> None:
    """On worker start, run the re-drive sweeper in this process (:mod:`worker.queue.redrive`):
    it enqueues again the searches, ingests, batch chunks and webhooks whose messages the
    broker lost (a webhook once overdue by the visibility timeout)."""
    app = getattr(sender, "app", None)
    settings = getattr(getattr(app, "conf", None), "sift_settings", None)
    if settings is None:
        return
    from worker.queue.redrive import start_sweeper

    start_sweeper(app, webhook_grace_seconds=visibility_timeout(settings))


def _start_liveness(sender: Any = None, **_: Any) -> None:
    """On worker start, keep this process's heartbeat and record the deliveries it holds, so
    a dead worker's work comes back in seconds (:mod:`worker.queue.liveness`)."""
    app = getattr(sender, "app", None)
    settings: Settings | None = getattr(getattr(app, "conf", None), "sift_settings", None)
    if settings is None or not settings.redis_url:
        return
    from worker.queue import liveness

    liveness.start(settings.redis_url, settings)


def _received(sender: Any = None, request: Any = None, **_: Any) -> None:
    from worker.queue import liveness

    liveness.received(request)


def _stopping(sig: str | None = None, **_: Any) -> None:
    """SIGTERM/SIGINT (a rolling restart): hand the batch items not yet started back at once,
    from a thread, since this runs in the signal handler (:mod:`worker.queue.items`)."""
    from worker.queue.base import hand_back_items

    threading.Thread(target=hand_back_items, name="sift-hand-back", daemon=True).start()


def _stopped(**_: Any) -> None:
    from worker.queue import liveness

    liveness.stop()


def _child_exited(pid: int | None = None, **_: Any) -> None:
    """A prefork child exits: in multiprocess mode, drop its share of the live gauges."""
    from worker.observability.metrics import mark_process_dead

    mark_process_dead(pid or os.getpid())


def _job_ids_in_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Celery configured its loggers: give their handlers the job id and Sift's format."""
    from worker.observability.logcontext import install

    for handler in logger.handlers if logger is not None else []:
        install(handler)


def create_celery_app(settings: Settings | None = None) -> Celery:
    """The worker's Celery app, with Sift's tasks registered."""
    settings = settings or load_settings()
    celery = Celery("sift", set_as_current=False)
    celery.config_from_object(celery_config(settings))
    celery.conf.sift_settings = settings
    celery.steps["consumer"].add(IntakeStep)  # pauses intake while batch items queue up
    celery.steps["consumer"].add(ReconnectStep)  # a reconnect opens the re-drive's urgent window
    worker_init.connect(_serve_metrics, weak=False, dispatch_uid="sift-worker-metrics")
    worker_ready.connect(_check_prices, weak=False, dispatch_uid="sift-prices")
    worker_ready.connect(_warm_up, weak=False, dispatch_uid="sift-warm-up")
    worker_init.connect(_start_redrive, weak=False, dispatch_uid="sift-redrive")
    worker_init.connect(_start_liveness, weak=False, dispatch_uid="sift-liveness")
    task_received.connect(_received, weak=False, dispatch_uid="sift-received")
    worker_shutting_down.connect(_stopping, weak=False, dispatch_uid="sift-stopping")
    worker_shutdown.connect(_warm_up_ends, weak=False, dispatch_uid="sift-warm-up-ends")
    worker_shutdown.connect(_stopped, weak=False, dispatch_uid="sift-stopped")
    worker_process_shutdown.connect(_child_exited, weak=False, dispatch_uid="sift-child-exit")
    after_setup_logger.connect(_job_ids_in_logs, weak=False, dispatch_uid="sift-log")
    after_setup_task_logger.connect(_job_ids_in_logs, weak=False, dispatch_uid="sift-task-log")
    import worker.queue.economy
    import worker.queue.tasks  # noqa: F401  (registers the shared tasks with every app)

    return celery


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """Build ``app`` on first access, so ``celery -A worker.queue.celery_app`` finds it lazily."""
    global _app
    if name == "app":
        if _app is None:
            _app = create_celery_app()
        return _app
    raise AttributeError(name)
