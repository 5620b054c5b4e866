"""``sift gateway`` and ``sift worker``: the services, for deployment."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import IO, Annotated, Any, Protocol, runtime_checkable

import typer
from rich.console import Console

from worker.cli._app import app
from worker.cli._common import (
    SETTING_OPTIONS,
    cli_settings,
    setting_help,
    sigterm_as_ctrl_c,
    stop,
)
from worker.cli._output import plain
from worker.cli._redis_checks import check_redis_at_start, redis_answers, require_redis
from worker.constants import ALL_QUEUES
from worker.errors import ConfigError, SiftError
from worker.processes.folder_locks import share_data_dir
from worker.processes.workers import (
    exit_by_deadline,
    follow_supervisor,
    resolve_processes,
    run_workers,
    temporary_metrics_dir,
)
from worker.settings import Settings

console = Console(emoji=False)
errors = Console(emoji=False, stderr=True)

# How long the gateway keeps an idle keep-alive connection: longer than a pooling client keeps
# one (httpx: 5 s; nginx upstream pools: 60 s), so a client never reuses a connection the
# gateway is closing (uvicorn's own 5 s raced httpx's: a request sent then had no answer)
GATEWAY_KEEP_ALIVE_SECONDS = 75
# How `sift gateway` ends when uvicorn could not start (a port taken), as uvicorn.run does
UVICORN_STARTUP_FAILURE = 3


@app.command("gateway")
def gateway(
    host: Annotated[str, typer.Option(help="interface to bind")] = "0.0.0.0",
    port: Annotated[
        int | None, typer.Option(help=setting_help("port to bind", "SIFT_GATEWAY_PORT"))
    ] = None,
) -> None:
    """Run one gateway (one uvicorn process), for deployment; scale with replicas."""
    overrides = {} if port is None else {"gateway_port": port}
    settings = cli_settings(options=SETTING_OPTIONS, **overrides)
    require_redis(settings, "the gateway")
    _require_api_keys(settings)  # needs no Redis: checked before its wait
    checked: list[int] = []  # the start checks' end: 0 passed, else the exit status
    if redis_answers(settings):  # checked before anything is served: a refusal is one line
        check_redis_at_start(settings, worker=False)
        checked.append(0)

    def start_checks() -> bool:
        """Wait for Redis and check it (on the app's thread, the gateway live meanwhile and
        ready once they pass): a refusal, its error line said, stops the gateway with it."""
        try:
            check_redis_at_start(settings, worker=False)
        except typer.Exit as refused:
            checked.append(refused.exit_code)
            server.should_exit = True
            return False
        checked.append(0)
        return True

    in_background = None if checked else start_checks  # a Redis not answering yet: waited for
    # imported once the checks above passed (half a second's CPU): a gateway they refuse
    # (no SIFT_REDIS_URL, bad keys, a Redis it must not run on) says so without them
    import uvicorn

    from api_gateway.app import serve

    server = uvicorn.Server(uvicorn.Config(
        lambda: serve(in_background), factory=True, host=host, port=settings.gateway_port,
        access_log=False, log_level=settings.log_level.lower(),
        timeout_keep_alive=GATEWAY_KEEP_ALIVE_SECONDS,
    ))  # fmt: skip
    # uvicorn stops on a Ctrl-C or a SIGTERM, then sends itself the signal again: a Ctrl-C's
    # KeyboardInterrupt ends it as uvicorn.run's does, and so does a SIGTERM's here (its
    # default killed the gateway with no line while it waited for Redis)
    with sigterm_as_ctrl_c() as signals, contextlib.suppress(KeyboardInterrupt):
        server.run()
    if checked and checked[0]:
        raise typer.Exit(checked[0])
    if not server.started:
        raise typer.Exit(UVICORN_STARTUP_FAILURE)
    if not checked:  # a Ctrl-C or SIGTERM (or uvicorn's stop) before Redis answered and passed
        errors.print(f"{signals.word} while waiting for Redis; the gateway stopped, never ready")
        raise typer.Exit(signals.code)
    if signals.terminated:  # a gateway that served: its status is the signal's, as before
        signal.raise_signal(signal.SIGTERM)


def _known_queues(value: str) -> str:
    """``--queues``: some of Sift's queues, comma-separated (spaces around a name are let be),
    else a usage error naming the option. Celery refuses a queue it has no route for only
    in each worker process, on a traceback, which the supervisor restarted for good.

    >>> _known_queues("sift.search, sift.webhooks")
    'sift.search,sift.webhooks'
    """
    names = [name.strip() for name in value.split(",")]
    for name in names:
        if name not in ALL_QUEUES:
            raise typer.BadParameter(
                f"{name!r} is no queue of Sift's: give some of {', '.join(ALL_QUEUES)}, "
                "comma-separated"
            )
    return ",".join(names)


@app.command("worker")
def worker(
    name: Annotated[str, typer.Option(help="node name, unique per host")] = "worker",
    concurrency: Annotated[
        int | None,
        typer.Option(help=setting_help("threads per process", "SIFT_WORKER_CONCURRENCY")),
    ] = None,
    pool: Annotated[
        str | None, typer.Option(help=setting_help("threads|prefork|solo", "SIFT_WORKER_POOL"))
    ] = None,
    queues: Annotated[
        str,
        # the default with spaces, which rich wraps at: as one word it is cut to fit its column
        typer.Option(
            callback=_known_queues,
            show_default=False,
            help=f"comma-separated queues \\[default: {', '.join(ALL_QUEUES)}]",
        ),
    ] = ",".join(ALL_QUEUES),
    loglevel: Annotated[
        str | None, typer.Option(help=setting_help("DEBUG|INFO|WARNING|ERROR", "SIFT_LOG_LEVEL"))
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            min=0, help=setting_help("worker processes, 0: one per core", "SIFT_WORKER_PROCESSES")
        ),
    ] = None,
    supervised_by: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run Celery workers, for deployment: one process per core by default, each with its
    threads pool, under one process that restarts any that exits and serves their metrics."""
    from worker.observability.logcontext import name_process
    from worker.queue.base import items_running, tasks_running
    from worker.queue.celery_app import create_celery_app, run_celery_worker, warming_up

    overrides: dict[str, Any] = {}
    if concurrency is not None:  # 0 too: a bad value, not the setting's default
        overrides["worker_concurrency"] = concurrency
    if pool:
        overrides["worker_pool"] = pool
    if processes is not None:
        overrides["worker_processes"] = processes
    if loglevel is not None:  # Celery's spelling, any case; checked as SIFT_LOG_LEVEL is
        overrides["log_level"] = loglevel.upper()
    settings = cli_settings(options=SETTING_OPTIONS, **overrides)
    _require_pool_concurrency(settings)
    _require_runtime_factory(settings)
    if not supervised_by:  # its supervisor checked
        require_redis(settings, "the workers")
    _require_api_keys(settings)  # each worker process, supervised or not: it signs with them
    shared = None  # this worker's share of the embedded data folder, held while it runs
    if not supervised_by:
        _require_model_cache(settings)
        _require_metrics_dir()
        _check_backend(settings)
        shared = _share_data_dir(settings)  # what needs no Redis is checked before its wait
    count = 1 if supervised_by else resolve_processes(settings.worker_processes)

    def wait_and_check() -> None:  # once /metrics is served: the orchestrator's startup probe
        check_redis_at_start(settings, worker=True)
        if not supervised_by:
            _require_one_data_folder(settings)

    if count > 1:
        args = ["--queues", queues]
        args += ["--concurrency", str(concurrency)] if concurrency is not None else []
        args += ["--pool", pool] if pool else []
        args += ["--loglevel", settings.log_level] if loglevel is not None else []
        run_workers(settings, count, name, args, before_start=wait_and_check)
        del shared  # held until here
        return
    if supervised_by:  # its supervisor set up the metrics files and serves them
        follow_supervisor(supervised_by)
        name_process(name)  # its log lines say which of the supervisor's processes wrote them
    else:
        _single_process_metrics(settings)
        _serve_single_process_metrics(settings)
        wait_and_check()
    # a stop ends even on a Redis that never answers, or under items that do not end
    who = f"sift worker {name}" if supervised_by else "sift worker"
    exit_by_deadline(settings, warming_up, items_running, tasks_running, who)
    run_celery_worker(create_celery_app(settings), name, queues.split(","), settings.log_level)


def _share_data_dir(settings: Settings) -> IO[str] | None:
    """The worker's share of the embedded backend's data folder, which ``sift
    embedded-downgrade`` refuses while any worker holds one (it saw only ``sift up``'s lock,
    and rebuilt the tables under a ``sift worker`` whose next write undid it); a worker
    started while a downgrade runs stops (exit 2). Elasticsearch: no folder, no share."""
    if settings.search_backend != "embedded":
        return None
    try:
        return share_data_dir(settings.data_dir.resolve())
    except SiftError as error:
        stop(plain(error))


def _require_one_data_folder(settings: Settings) -> None:
    """Stop (exit 2, one line naming ``SIFT_DATA_DIR`` and the other folder) a worker on the
    embedded backend whose Redis a live worker of another data folder holds
    (:mod:`worker.queue.data_folder`): each took a share of the jobs, and every index was
    split between the folders with each job ``succeeded``. Passing, it holds the Redis for
    its folder until its processes' heartbeats do (the first beat of each drops this hold).
    Elasticsearch: no folder, no check."""
    if settings.search_backend != "embedded" or not settings.redis_url:
        return
    import redis

    from worker.queue import data_folder
    from worker.redis_client import START_CHECK_TIMEOUT_SECONDS, connect

    folder = data_folder.DataFolder.of(settings.data_dir)
    client = connect(settings.redis_url, socket_timeout=START_CHECK_TIMEOUT_SECONDS)
    try:  # a Redis gone again since it answered is no refusal: the beats claim the folder
        other = data_folder.claim(
            client, folder, data_folder.start_holder(), settings.worker_dead_after_seconds
        )
    except redis.RedisError:
        other = None
    finally:
        client.close()
    if other is not None:
        stop(
            f"SIFT_DATA_DIR ({plain(folder.where)}): a live worker on this Redis serves "
            f"another data folder, {plain(other)}; every worker on one Redis must share one "
            "SIFT_DATA_DIR on one host: give this one that folder, or stop that folder's "
            "workers first (past one host, run on Elasticsearch)"
        )


def _require_api_keys(settings: Settings) -> None:
    """Stop (exit 2, one line naming it) a gateway or worker whose ``SIFT_API_KEYS_FILE``
    cannot be read or holds a bad entry, before it starts. The gateway printed the app
    factory's traceback through uvicorn (166 lines); the workers started, and every webhook
    raised on the file when it was signed. A worker signs with the secrets it reads here, at its
    start: an edit of the file takes effect when the workers are restarted."""
    try:
        settings.all_api_keys()
    except ConfigError as error:
        stop(plain(error))


def _require_runtime_factory(settings: Settings) -> None:
    """Stop (exit 2, one line naming it) a worker whose ``SIFT_RUNTIME_FACTORY`` cannot be
    imported: it was imported at the first job, so the worker started and failed every job."""
    from worker.queue.base import runtime_factory

    try:
        runtime_factory(settings)
    except ConfigError as error:
        stop(plain(error))


def _require_pool_concurrency(settings: Settings) -> None:
    """Stop (exit 2, one line naming both) a prefork worker left at the threads pool's
    concurrency: ``SIFT_WORKER_CONCURRENCY``'s default, 300 threads, forked 300 children per
    worker process, each loading the embedding model at its first task."""
    if settings.worker_pool == "prefork" and "worker_concurrency" not in settings.model_fields_set:
        stop(
            f"SIFT_WORKER_POOL=prefork forks SIFT_WORKER_CONCURRENCY children per worker "
            f"process, each with its own embedding model: the default, "
            f"{settings.worker_concurrency}, is the threads pool's; set SIFT_WORKER_CONCURRENCY "
            f"(or --concurrency) for prefork, e.g. 2"
        )


def _require_model_cache(settings: Settings) -> None:
    """Stop (exit 2, one line naming it) workers whose ``SIFT_MODEL_CACHE_DIR``, where each
    process's warm-up makes or reads the int8 embedding graph, cannot be made: the warm-up
    only logged its failure, and the worker ran on, each job meeting the same error."""
    if not settings.embedding_int8_compute:
        return
    folder = settings.model_cache_dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        stop(
            f"SIFT_MODEL_CACHE_DIR ({plain(folder)}): cannot make it: "
            f"{plain(exc.strerror or exc)}; give a folder this user can write "
            "(or SIFT_EMBEDDING_INT8_COMPUTE=false)"
        )


def _require_metrics_dir() -> None:
    """Stop (exit 2, one line naming it) a worker whose ``PROMETHEUS_MULTIPROC_DIR`` is no
    folder it can make and write: the metrics files' set-up (its supervisor's, or the worker
    process's own) raised its ``OSError`` as a traceback of 49 lines, exit 1."""
    from worker.observability import metrics

    directory = metrics.multiprocess_dir()
    if directory is None:
        return
    try:
        metrics.ensure_multiprocess_dir()
    except OSError as exc:
        stop(
            f"PROMETHEUS_MULTIPROC_DIR ({plain(directory)}): cannot make it: "
            f"{plain(exc.strerror or exc)}; give a folder this user can write, or unset it"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        stop(
            f"PROMETHEUS_MULTIPROC_DIR ({plain(directory)}): cannot write in it; give a "
            "folder this user can write, or unset it"
        )


def _single_process_metrics(settings: Settings) -> None:
    """Put a worker run as one process (no supervisor) in multiprocess mode when it needs it.

    Prefork children write their metrics to files. A folder given by
    ``PROMETHEUS_MULTIPROC_DIR`` (the Docker image sets it) may hold an earlier run's files:
    emptied, or a restarted container's PID 1 would take its predecessor's live gauges (jobs
    running at the kill) for its own, for good."""
    from worker.observability import metrics

    if settings.worker_pool == "prefork" or metrics.multiprocess_dir() is not None:
        directory = metrics.multiprocess_dir() or temporary_metrics_dir()
        metrics.setup_multiprocess(directory)


def _serve_single_process_metrics(settings: Settings) -> None:
    """Serve a worker run as one process's ``/metrics`` before its wait for Redis, which an
    orchestrator's startup probe reads (Celery's ``worker_init`` served it only after the
    wait: a pod waiting past the probe's 120 s was killed). Celery's own call then finds it
    served (:func:`~worker.observability.metrics.serve_worker_metrics` serves once), or its
    port waited for: one in use (the worker this one replaces, still stopping) is bound once
    free."""
    from worker.observability.metrics import serve_worker_metrics_when_free

    if not settings.worker_metrics_port:
        return
    try:
        serve_worker_metrics_when_free(
            settings, lambda line: errors.print(plain(line), soft_wrap=True)
        )
    except OSError as exc:
        errors.print(
            f"[yellow]warning:[/yellow] worker metrics not served on "
            f":{settings.worker_metrics_port}: {plain(exc)}",
            soft_wrap=True,
        )


def _check_backend(settings: Settings) -> None:
    """The backend is checked once, at the worker's start, not by each job it would fail.
    What this Sift cannot serve stops it (exit 2): a missing setting, a data dir of another
    schema, Elasticsearch indexes of the old shared layout (their documents would vanish from
    every search). So does any other error of the embedded backend, whose data dir is local;
    an Elasticsearch cluster not answering yet only warns, since jobs retry."""
    from worker.runtime.bootstrap import build_backend

    try:
        backend = build_backend(settings)
        try:
            backend.check()
        finally:
            if isinstance(backend, _Closable):
                backend.close()  # the workers open their own
    except SiftError as error:
        if isinstance(error, ConfigError) or settings.search_backend == "embedded":
            stop(plain(error))
        errors.print(  # a diagnostic, on stderr with the errors
            f"[yellow]warning:[/yellow] could not check the indexes' layout: {plain(error)}"
        )


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...
