"""The Celery app: the settings of :mod:`worker.queue.config`, Sift's tasks registered, and
the worker's start and stop hooks (metrics, warm-up, the re-drive, liveness, hand-back, the
refused provider deletes asked again).

``celery -A worker.queue.celery_app worker`` finds ``app`` here; it is built on first
access (PEP 562), so importing this module does no work. The tasks are imported when the
app is made (:func:`create_celery_app`), and import nothing of this module: the app is
above them.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from datetime import UTC, datetime
from typing import Any

import kombu.asynchronous.timer as kombu_timer
import kombu.transport.redis as kombu_redis
from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    task_received,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from worker import clock
from worker.constants import (
    BATCH_QUEUE,
    INGEST_QUEUE,
    SEARCH_QUEUE,
    WARM_UP_STOP_WAIT_SECONDS,
)
from worker.queue.base import QUIET_HAND_BACKS, QUIET_REQUEUES
from worker.queue.config import celery_config, visibility_timeout, warn_if_tombstones_too_short
from worker.queue.intake import IntakeStep
from worker.queue.redrive import ReconnectStep
from worker.settings import Settings, load_settings

log = logging.getLogger(__name__)

# How long a stopping worker waits for its warm-up (seconds): making the int8 graph takes a
# few, loading the model about one
_warming: threading.Thread | None = None  # this process's warm-up (see _warm_up)


def _settings_of(sender: Any) -> Settings | None:
    """The settings the app of a signal's ``sender`` carries (None: no app, or not Sift's)."""
    settings: Settings | None = getattr(
        getattr(getattr(sender, "app", None), "conf", None), "sift_settings", None
    )
    return settings


def _serve_metrics(sender: Any = None, **_: Any) -> None:
    """On worker start, serve ``/metrics`` on ``SIFT_WORKER_METRICS_PORT`` (0 turns it off).

    A prefork worker not in multiprocess mode yet (``celery worker`` run on this app, which
    ``sift worker``'s own set-up does not reach) is switched to it here, before the pool
    forks, so its children's counts reach ``/metrics``."""
    settings = _settings_of(sender)
    if settings is None or not settings.worker_metrics_port:
        return
    from worker.observability.metrics import (
        multiprocess_dir,
        serve_worker_metrics_when_free,
        setup_multiprocess,
    )

    if settings.worker_pool == "prefork" and multiprocess_dir() is None:
        from worker.processes.workers import temporary_metrics_dir

        setup_multiprocess(temporary_metrics_dir())

    try:
        served = serve_worker_metrics_when_free(settings, log.warning)
    except OSError as exc:
        log.warning("worker metrics not served on :%d: %s", settings.worker_metrics_port, exc)
    else:
        if served:
            log.info("worker metrics on :%d/metrics", settings.worker_metrics_port)


def _check_prices(sender: Any = None, **_: Any) -> None:
    """On worker start (ready: its logging is set up by then), warn if the generation model
    has no price, or if there is none, or if SIFT_RATE_LIMITS names another model
    (worker/runtime/bootstrap.py), or if the backend's tombstones would not outlast an
    ingest's redelivery (:func:`warn_if_tombstones_too_short`)."""
    settings = _settings_of(sender)
    if settings is not None:
        from worker.runtime.bootstrap import (
            warn_if_no_generation_model,
            warn_if_unpriced,
            warn_if_unused_rate_limits,
        )

        warn_if_unpriced(settings)
        warn_if_no_generation_model(settings)
        warn_if_unused_rate_limits(settings)
        warn_if_tombstones_too_short(settings)


def _warm_up(sender: Any = None, **_: Any) -> None:
    """On worker start (ready), build this process's runtime and embed one text, on a thread
    of its own: the first search or ingest paid for it (the model session's load, about a
    second; on a machine's first start also the int8 graph's making, a few more). Only a
    threads-pool worker that takes searches, batches or ingests: a prefork parent never runs
    them (each child warms up as it starts: :func:`_child_started`), and a webhooks-only
    worker never embeds."""
    app = getattr(sender, "app", None)
    settings = _settings_of(sender)
    if settings is None or not settings.redis_url or settings.worker_pool != "threads":
        return
    _warm_up_thread(app, settings)


def _warm_up_thread(app: Any, settings: Settings) -> None:
    """:func:`_warm_up`'s thread, started when ``app``'s worker takes what embeds."""
    consumed = set(app.amqp.queues.consume_from)
    if not consumed & {SEARCH_QUEUE, BATCH_QUEUE, INGEST_QUEUE}:
        return
    from worker.queue.base import warm_up

    global _warming
    _warming = threading.Thread(target=warm_up, args=(settings,), name="sift-warm-up", daemon=True)
    _warming.start()


def _ask_refused_deletes(sender: Any = None, **_: Any) -> None:
    """On worker start (ready), ask again, once, the deletes of erased batches' provider
    batches that the provider refused for the key (a key is fixed by a restart): see
    :func:`worker.queue.economy.deletion.ask_refused_again`."""
    app = getattr(sender, "app", None)
    settings = _settings_of(sender)
    if app is None or settings is None or not settings.redis_url:
        return
    from worker.queue.economy.deletion import ask_refused_at_start

    ask_refused_at_start(app, settings.redis_url, settings.result_retention_seconds)


def warming_up() -> bool:
    """This process's warm-up is still running: a stop waits for it (:func:`_warm_up_ends`),
    and the process's stop deadline counts that wait
    (:func:`worker.processes.workers.exit_by_deadline`)."""
    return _warming is not None and _warming.is_alive()


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


def _open_files(instance: Any = None, **_: Any) -> None:
    """On worker start (``sift worker``'s, each process of it, and a ``celery worker`` on
    this app), raise the soft limit of open files to what the settings may hold, or say in
    the log that it is short (:func:`worker.processes.machine.raise_open_files_limit`).
    Once Celery's logging is set up (``worker_init`` comes before: its lines were bare, an
    INFO line lost) and before the pool starts, so a prefork child inherits the limit."""
    settings = _settings_of(instance)
    if settings is None:
        return
    from worker.processes.machine import raise_open_files_limit

    raise_open_files_limit(settings)


def _start_redrive(sender: Any = None, **_: Any) -> None:
    """On worker start, run the re-drive sweeper in this process (:mod:`worker.queue.redrive`):
    it enqueues again the searches, ingests, batch chunks and webhooks whose messages the
    broker lost (a webhook once overdue by the visibility timeout)."""
    app = getattr(sender, "app", None)
    settings = _settings_of(sender)
    if settings is None:
        return
    from worker.queue.redrive import start_sweeper

    start_sweeper(app, webhook_grace_seconds=visibility_timeout(settings))


def _start_liveness(sender: Any = None, **_: Any) -> None:
    """On worker start, keep this process's heartbeat and record the deliveries it holds, so
    a dead worker's work comes back in seconds (:mod:`worker.queue.liveness`); its beats also
    say whether it can send economy batches, which needs the queues it consumes: those
    selected (``-Q``, before ``worker_init``), read at each beat, as an operator's
    ``cancel_consumer`` or ``add_consumer`` changes them at run time. Not those the consumer
    reads at the moment: the batch queue's intake pauses (:mod:`worker.queue.intake`) while
    the worker is busy, and it still takes the submission later."""
    settings = _settings_of(sender)
    if settings is None or not settings.redis_url:
        return
    from worker.queue import liveness

    app = getattr(sender, "app", None)
    if app is None:
        liveness.start(settings.redis_url, settings)
        return
    # a dict the consumer's thread changes: the beat's one lookup in it is atomic
    liveness.start(settings.redis_url, settings, lambda: app.amqp.queues.consume_from)


def _received(sender: Any = None, request: Any = None, **_: Any) -> None:
    from worker.queue import liveness

    liveness.received(request)


# What a prefork parent's stop sends its children: Celery's warm shutdown tells them nothing,
# and billiard uses SIGUSR1 for its soft time limit
HAND_BACK_SIGNAL = signal.SIGUSR2


def _stopping(sig: str | None = None, **_: Any) -> None:
    """SIGTERM/SIGINT (a rolling restart): hand the batch items not yet started back at once,
    from a thread, since this runs in the signal handler (:mod:`worker.queue.items`). A
    prefork parent runs no item: its children hold them, and each is told to hand back its
    own (:func:`_child_started`)."""
    from billiard.process import active_children

    from worker.queue.base import hand_back_items

    threading.Thread(target=hand_back_items, name="sift-hand-back", daemon=True).start()
    for child in active_children():
        if child.pid:
            os.kill(child.pid, HAND_BACK_SIGNAL)


def _child_started(app: Any, **_: Any) -> None:
    """A prefork child starts: its parent's stop reaches it as :data:`HAND_BACK_SIGNAL`, and
    it warms up as a threads-pool worker does at its start, so no first job (a replacing
    child's too) waits for the model."""
    signal.signal(HAND_BACK_SIGNAL, lambda *_: _stopping())
    settings: Settings | None = getattr(app.conf, "sift_settings", None)
    if settings is not None and settings.redis_url:
        _warm_up_thread(app, settings)


def _stopped(**_: Any) -> None:
    from worker.queue import liveness

    liveness.stop()


def _child_exited(pid: int | None = None, **_: Any) -> None:
    """A prefork child exits: once its warm-up has ended (:func:`_warm_up_ends`), in
    multiprocess mode, drop its share of the live gauges."""
    from worker.observability.metrics import mark_process_dead

    _warm_up_ends()

    mark_process_dead(pid or os.getpid())


def _job_ids_in_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Celery configured its loggers: give their handlers the job id and Sift's format."""
    from worker.observability.logcontext import install

    for handler in logger.handlers if logger is not None else []:
        install(handler)


def _job_begins(args: Any = None, **_: Any) -> None:
    """A task starts: every record until it ends carries its job's id, Celery's own lines
    around the task's call too (its ``succeeded in``, ``retry: Retry in`` and failure lines,
    logged after the call returned)."""
    from worker.observability.logcontext import enter_job
    from worker.queue.base import job_id_of

    enter_job(job_id_of(args))


def _clock_read(task: Any = None, **_: Any) -> None:
    """A task starts: in a prefork child, the shared clock read again when it is stale
    (:func:`worker.queue.liveness.read_clock_in_child`)."""
    from worker.queue import liveness
    from worker.queue.base import SiftTask

    if isinstance(task, SiftTask):
        liveness.read_clock_in_child(task.context.store.redis.time)


def _job_ends(**_: Any) -> None:
    from worker.observability.logcontext import leave_job

    leave_job()


class SharedClockCelery(Celery):  # type: ignore[misc]
    """Celery on the shared clock (:mod:`worker.clock`): a countdown (a retry's, a webhook's
    hop, an economy poll's) becomes an ETA in the message, which another worker, on another
    host, waits for. Celery reads the ETA from the sender's wall clock and waits for it on the
    receiver's: a message sent by a host 3 minutes ahead waited 3 minutes more on every
    other host, and one sent by a host behind ran early."""

    def now(self) -> datetime:
        return datetime.fromtimestamp(clock.now(), UTC).astimezone(self.timezone)


def etas_on_the_shared_clock() -> None:
    """A received message's ETA waited for on the shared clock, as :class:`SharedClockCelery`
    wrote it: kombu's timer turns an ETA into its monotonic time with the wall clock it
    reads as ``time.time`` at module level, which is this host's own (no setting chooses
    it). Harmless where nothing calibrates the clock: it reads this host's wall clock then."""
    kombu_timer._time = clock.now  # type: ignore[attr-defined]


def deliveries_on_the_shared_clock() -> None:
    """When a message was taken, and whether it is past the visibility timeout, on the
    shared clock: kombu's Redis transport records a take in ``unacked_index`` with the
    ``time`` it imported at module level, this host's wall clock, and each worker's sweep
    (``QoS.restore_visible``) puts back the messages taken longer ago than the timeout by
    its own. A worker ahead by more than the timeout put back every live worker's message,
    run a second time; one behind had its own put back by every other worker. Those two
    are the module's only reads of ``time`` (kombu 5.x); a kombu whose ``time`` is no
    longer that function is left as it is, with a warning."""
    if kombu_redis.time not in (time.time, clock.now):  # type: ignore[attr-defined]
        log.warning("kombu.transport.redis.time is not time.time: its take times stay on "
                    "this host's clock")  # fmt: skip
        return
    kombu_redis.time = clock.now  # type: ignore[attr-defined]


def create_celery_app(settings: Settings | None = None) -> Celery:
    """The worker's Celery app, with Sift's tasks registered."""
    settings = settings or load_settings()
    etas_on_the_shared_clock()
    deliveries_on_the_shared_clock()
    celery = SharedClockCelery("sift", set_as_current=False)
    celery.config_from_object(celery_config(settings))
    celery.conf.sift_settings = settings
    celery.steps["consumer"].add(IntakeStep)  # pauses intake while batch items queue up
    celery.steps["consumer"].add(ReconnectStep)  # a reconnect opens the re-drive's urgent window
    celeryd_after_setup.connect(_open_files, weak=False, dispatch_uid="sift-open-files")
    worker_init.connect(_serve_metrics, weak=False, dispatch_uid="sift-worker-metrics")
    worker_ready.connect(_check_prices, weak=False, dispatch_uid="sift-prices")
    worker_ready.connect(_warm_up, weak=False, dispatch_uid="sift-warm-up")
    worker_ready.connect(_ask_refused_deletes, weak=False, dispatch_uid="sift-refused-deletes")
    worker_init.connect(_start_redrive, weak=False, dispatch_uid="sift-redrive")
    worker_init.connect(_start_liveness, weak=False, dispatch_uid="sift-liveness")
    task_received.connect(_received, weak=False, dispatch_uid="sift-received")
    worker_shutting_down.connect(_stopping, weak=False, dispatch_uid="sift-stopping")
    worker_shutdown.connect(_warm_up_ends, weak=False, dispatch_uid="sift-warm-up-ends")
    worker_shutdown.connect(_stopped, weak=False, dispatch_uid="sift-stopped")
    worker_process_init.connect(
        functools.partial(_child_started, celery), weak=False, dispatch_uid="sift-child-start"
    )
    worker_process_shutdown.connect(_child_exited, weak=False, dispatch_uid="sift-child-exit")
    task_prerun.connect(_job_begins, weak=False, dispatch_uid="sift-job-begins")
    task_prerun.connect(_clock_read, weak=False, dispatch_uid="sift-clock-read")
    task_postrun.connect(_job_ends, weak=False, dispatch_uid="sift-job-ends")
    after_setup_logger.connect(_job_ids_in_logs, weak=False, dispatch_uid="sift-log")
    after_setup_task_logger.connect(_job_ids_in_logs, weak=False, dispatch_uid="sift-task-log")
    logging.getLogger("celery.app.trace").addFilter(QUIET_HAND_BACKS)
    logging.getLogger("kombu.transport.virtual.base").addFilter(QUIET_REQUEUES)
    import worker.queue.economy
    import worker.queue.rewrite_task
    import worker.queue.tasks
    import worker.queue.webhook_task  # noqa: F401  (register the shared tasks with every app)

    return celery


def run_celery_worker(celery: Celery, name: str, queues: list[str], loglevel: str) -> None:
    """Run one Celery worker on ``queues`` until it stops: what ``celery worker -n
    <name>@%h -Q <queues> --without-gossip --without-mingle`` runs, started without Celery's
    command line, whose import (click-repl, prompt_toolkit) took a quarter of a CPU-second of
    each worker process's start. Its exit code is Celery's to log, not the process's, as it
    was through ``worker_main``."""
    from celery.utils.nodenames import default_nodename, host_format

    celery.Worker(
        hostname=host_format(default_nodename(f"{name}@%h")), queues=queues, loglevel=loglevel,
        without_gossip=True, without_mingle=True, no_color=False, quiet=False,
    ).start()  # fmt: skip


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """Build ``app`` on first access, so ``celery -A worker.queue.celery_app`` finds it lazily."""
    global _app
    if name == "app":
        if _app is None:
            _app = create_celery_app()
        return _app
    raise AttributeError(name)
