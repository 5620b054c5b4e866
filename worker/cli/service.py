"""``sift up``, ``sift gateway``, ``sift worker`` and ``sift demo``: running the stack."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, NoReturn, Protocol, runtime_checkable

import typer
from rich.console import Console

from worker.cli._app import app
from worker.cli._common import (
    EXIT_INTERRUPTED,
    EXIT_ITEMS_FAILED,
    STACK_REDIS_FILE,
    a_folder,
    option_error,
    setting_help,
    sigterm_as_ctrl_c,
)
from worker.cli._output import plain, print_result, sample_path
from worker.constants import ALL_QUEUES
from worker.errors import ConfigError, SiftError
from worker.processes.stack import (
    Service,
    StartInterrupted,
    StartRefused,
    Supervisor,
    adopt_logs,
    check_port_free,
    child_env,
    claim_data_dir,
    exclude_workers,
    free_port,
    gateway_service,
    holds_data_dir,
    redis_service,
    require_redis_7,
    running,
    share_data_dir,
    sift_command,
    worker_service,
)
from worker.processes.workers import (
    exit_by_deadline,
    follow_supervisor,
    resolve_processes,
    run_workers,
    supervisor_stop_deadline,
    temporary_metrics_dir,
)
from worker.settings import Settings, load_settings

console = Console(emoji=False)
errors = Console(emoji=False, stderr=True)
DEV_KEY_FILE = "dev-api-key.json"  # in the data folder: the development key and its secret
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
    import uvicorn

    from api_gateway.app import serve

    overrides = {} if port is None else {"gateway_port": port}
    settings = _settings(options=("gateway_port",), **overrides)
    _require_redis(settings, "the gateway")
    _require_api_keys(settings)  # needs no Redis: checked before its wait
    checked: list[int] = []  # the start checks' end: 0 passed, else the exit status
    if _redis_answers(settings):  # checked before anything is served: a refusal is one line
        _check_redis_at_start(settings, worker=False)
        checked.append(0)

    def start_checks() -> bool:
        """Wait for Redis and check it (on the app's thread, the gateway live meanwhile and
        ready once they pass): a refusal, its error line said, stops the gateway with it."""
        try:
            _check_redis_at_start(settings, worker=False)
        except typer.Exit as refused:
            checked.append(refused.exit_code)
            server.should_exit = True
            return False
        checked.append(0)
        return True

    in_background = None if checked else start_checks  # a Redis not answering yet: waited for
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
        str, typer.Option(callback=_known_queues, help="comma-separated queues")
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
    settings = _settings(options=tuple(overrides), **overrides)
    _require_pool_concurrency(settings)
    _require_runtime_factory(settings)
    if not supervised_by:  # its supervisor checked
        _require_redis(settings, "the workers")
    _require_api_keys(settings)  # each worker process, supervised or not: it signs with them
    shared = None  # this worker's share of the embedded data folder, held while it runs
    if not supervised_by:
        _require_model_cache(settings)
        _require_metrics_dir()
        _check_backend(settings)
        shared = _share_data_dir(settings)  # what needs no Redis is checked before its wait
    count = 1 if supervised_by else resolve_processes(settings.worker_processes)

    def wait_and_check() -> None:  # once /metrics is served: the orchestrator's startup probe
        _check_redis_at_start(settings, worker=True)
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
        _stop(plain(error))


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
        _stop(
            f"SIFT_DATA_DIR ({plain(folder.where)}): a live worker on this Redis serves "
            f"another data folder, {plain(other)}; every worker on one Redis must share one "
            "SIFT_DATA_DIR on one host: give this one that folder, or stop that folder's "
            "workers first (past one host, run on Elasticsearch)"
        )


def _stop(message: str, code: int = 2) -> NoReturn:
    """End the command with ``error: message`` on stderr, as every command's error (it went
    to stdout), unwrapped (never cut mid-path) and exit ``code``: 2 for what the user must
    change (a setting, an option), 1 for what failed."""
    errors.print(f"[red]error:[/red] {message}", soft_wrap=True)
    raise typer.Exit(code)


def _require_redis(settings: Settings, what: str) -> None:
    """Stop (exit 2, one line) a gateway or worker with no Redis to share, before it starts:
    the worker's processes each died on it and were started again for as long as it ran."""
    if not settings.redis_url:
        _stop(
            f"SIFT_REDIS_URL is required to run {what}: the Redis the gateways and workers "
            "share (`sift up` runs one of its own)"
        )


#: The pauses between a gateway's or worker's tries of a Redis not answering yet: soon at first
#: (pods starting together), then every few seconds for as long as it takes, as Celery's broker
START_WAIT_PAUSES = (0.5, 1.0, 2.0, 5.0)


def _redis_answers(settings: Settings) -> bool:
    """Whether the Redis of ``SIFT_REDIS_URL`` answers now (one ``PING``)."""
    from worker.redis_client import unanswered

    url = settings.redis_url
    return url is not None and not unanswered(url)


def _check_redis_at_start(settings: Settings, *, worker: bool) -> None:
    """The start checks of the Redis a gateway or the workers (``worker``: ``sift worker``,
    ``sift up`` on ``SIFT_REDIS_URL``) run on, once it answers (:func:`_wait_for_redis`): each
    check takes a Redis not answering for no refusal. Both: its version, ``noeviction``, the
    AOF; the workers also its database and Pub/Sub channels (a gateway answers a database
    Redis refuses with ``503`` naming the URL, and subscribes to no channel)."""
    _wait_for_redis(settings)
    if worker:
        _require_redis_database(settings)
    _check_redis_config(settings, channels=worker)


def _wait_for_redis(settings: Settings) -> None:
    """Before a gateway's or worker's start checks read its Redis, wait until it answers,
    saying so each try and never giving up, as Celery waits for its broker. Each check takes a
    Redis not answering for no refusal, so one started before its Redis (pods starting
    together, a Redis restarting) skipped them all: on a user without Pub/Sub channels the
    worker processes died and were restarted for good, and on an evicting Redis, or one older
    than 7.0, the workers and the gateway ran on. A worker serves its ``/metrics`` meanwhile,
    and a gateway its ``/healthz`` (``/readyz`` 503 until the checks pass: it waits on a
    thread of its own), which an orchestrator's probes read: a pod waiting past its start-up
    probe was restarted into a crash loop. A Ctrl-C meanwhile stops a worker with one line,
    exit 130: nothing has been started (it ended with no word); a SIGTERM too, said
    "terminated", exit 143: the signal's default killed it past every clean-up, and the
    supervisor's metrics folder was left until the next start. A Redis that answers at once
    costs one ``PING``."""
    from worker.redis_client import unanswered

    tries = 0
    try:
        with sigterm_as_ctrl_c() as signals:
            while settings.redis_url and (why := unanswered(settings.redis_url)):
                pause = START_WAIT_PAUSES[min(tries, len(START_WAIT_PAUSES) - 1)]
                errors.print(
                    f"[yellow]waiting:[/yellow] cannot connect to the Redis of SIFT_REDIS_URL "
                    f"({plain(why)}); the start checks need it: trying again in {pause:g} s",
                    soft_wrap=True,
                )
                time.sleep(pause)
                tries += 1
    except KeyboardInterrupt:
        errors.print(f"{signals.word} while waiting for Redis; nothing was started")
        raise typer.Exit(signals.code) from None


def _require_redis_database(settings: Settings) -> None:
    """Stop (exit 2, one line naming ``SIFT_REDIS_URL``) a worker, or ``sift up`` on a Redis
    of its own choosing, whose Redis refuses the URL's database (``/99`` on a Redis of 16):
    Celery took the refusal for a Redis not up yet and tried again, up to 100 times, as the
    liveness and the re-drive did for as long as it ran. A Redis not answering is waited for,
    as before: only a refusal Redis itself gives stops it."""
    from worker.redis_client import DB_OUT_OF_RANGE, refused_database

    if settings.redis_url and (refusal := refused_database(settings.redis_url)):
        why = "its database" if refusal.startswith(DB_OUT_OF_RANGE) else "the connection"
        hint = (
            ": a Redis has databases 0 to 15 unless its `databases` setting gives more"
            if refusal.startswith(DB_OUT_OF_RANGE)
            else ""
        )
        _stop(f"SIFT_REDIS_URL: Redis refuses {why} ({refusal}){hint}")


def _check_redis_config(settings: Settings, *, channels: bool = True) -> None:
    """The start checks of how the Redis of ``SIFT_REDIS_URL`` is configured: Pub/Sub
    channels for the workers (``channels``), ``noeviction``, and the AOF (warned of only);
    first, its version. One ``INFO`` serves the three it reads (each opened a connection)."""
    from worker.redis_client import info_at_start

    info = info_at_start(settings.redis_url, "default") if settings.redis_url else None
    _require_redis_version(info)
    if channels:
        _require_channels(settings)
    _require_noeviction(info)
    _warn_no_aof(info)


def _require_redis_version(info: dict[str, Any] | None) -> None:
    """Stop (exit 2, one line naming the version) a gateway or worker whose Redis is older than
    7.0: a script of Sift's declares flags, which Redis 6 refuses to load, so a batch chunk's
    run could never let its claim go. Read from ``INFO``'s ``info`` (server); unknown (INFO
    refused) lets it start, as the other checks do."""
    from worker.redis_client import OLDEST_REDIS, too_old

    if version := too_old(info):
        _stop(
            f"SIFT_REDIS_URL: Redis {version} is older than Sift needs "
            f"({'.'.join(map(str, OLDEST_REDIS))} or later): upgrade it"
        )


def _require_channels(settings: Settings) -> None:
    """Stop (exit 2, one line naming ``&*``) a worker whose Redis user may not use Pub/Sub
    channels: Celery's remote control subscribes to one, and each worker process died on the
    refusal ("Unrecoverable error", exit 0) and was started again for as long as it ran,
    while the gateway took jobs no worker would run."""
    from worker.redis_client import refused_channels

    if settings.redis_url and (refusal := refused_channels(settings.redis_url)):
        _stop(
            f"SIFT_REDIS_URL: Redis refuses this user the Pub/Sub channel Celery's workers "
            f"subscribe to ({refusal}): give the user channel access, `&*` (ACL SETUSER "
            "<user> &*; Redis 7 gives a new user none: acl-pubsub-default resetchannels)"
        )


def _require_noeviction(info: dict[str, Any] | None) -> None:
    """Stop (exit 2, one line naming the setting) a gateway or worker whose Redis evicts keys
    when full (``allkeys-lru``, a common managed default, with a ``maxmemory``): it is the job
    store and the broker, and an evicting one lost accepted batches, finished searches (both
    read 404) and a live worker's heartbeat, silently. With no ``maxmemory`` (0: no limit)
    Redis is never full and evicts nothing, so that policy is only warned of, once: it was
    refused as if it evicted. Read from ``INFO``'s ``info`` (memory); a user refused INFO is
    warned of once and let start; a gateway or worker waits for a Redis not answering yet
    (:func:`_wait_for_redis`)."""
    from worker.redis_client import evicting_policy, has_memory_limit

    if not (policy := evicting_policy(info)):
        return
    if has_memory_limit(info):
        _stop(
            f"SIFT_REDIS_URL: Redis evicts keys when full (maxmemory-policy {policy}), and Sift's "
            "jobs and messages would go with them: set `maxmemory-policy noeviction` on it"
        )
    errors.print(
        f"[yellow]warning:[/yellow] SIFT_REDIS_URL: Redis has maxmemory-policy {policy} and "
        "maxmemory 0 (no limit), so it evicts nothing now; a maxmemory set later would have it "
        "drop Sift's jobs and messages when full: set `maxmemory-policy noeviction` on it",
        soft_wrap=True,
    )


def _warn_no_aof(info: dict[str, Any] | None) -> None:
    """Say once, at start, that a gateway's or worker's Redis keeps no AOF: a restart of it
    loses every job and message (those its RDB snapshot, if any, missed), which no re-drive
    can recover. Not refused: a dev Redis may run so; deploy/README.md asks for the AOF. Read
    from ``INFO``'s ``info`` (persistence)."""
    from worker.redis_client import keeps_no_aof

    if keeps_no_aof(info):
        errors.print(
            "[yellow]warning:[/yellow] SIFT_REDIS_URL: Redis keeps no AOF (appendonly no), so a "
            "restart of it loses every job and message its last RDB snapshot missed (all of "
            'them without one, save ""): set `appendonly yes` and `appendfsync everysec` on it',
            soft_wrap=True,
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
        _stop(plain(error))


def _require_runtime_factory(settings: Settings) -> None:
    """Stop (exit 2, one line naming it) a worker whose ``SIFT_RUNTIME_FACTORY`` cannot be
    imported: it was imported at the first job, so the worker started and failed every job."""
    from worker.queue.base import runtime_factory

    try:
        runtime_factory(settings)
    except ConfigError as error:
        _stop(plain(error))


def _require_pool_concurrency(settings: Settings) -> None:
    """Stop (exit 2, one line naming both) a prefork worker left at the threads pool's
    concurrency: ``SIFT_WORKER_CONCURRENCY``'s default, 300 threads, forked 300 children per
    worker process, each loading the embedding model at its first task."""
    if settings.worker_pool == "prefork" and "worker_concurrency" not in settings.model_fields_set:
        _stop(
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
        _stop(
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
        _stop(
            f"PROMETHEUS_MULTIPROC_DIR ({plain(directory)}): cannot make it: "
            f"{plain(exc.strerror or exc)}; give a folder this user can write, or unset it"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        _stop(
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
    served (:func:`~worker.observability.metrics.serve_worker_metrics` serves once)."""
    from worker.observability.metrics import serve_worker_metrics

    if not settings.worker_metrics_port:
        return
    try:
        serve_worker_metrics(settings)
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
            _stop(plain(error))
        errors.print(  # a diagnostic, on stderr with the errors
            f"[yellow]warning:[/yellow] could not check the indexes' layout: {plain(error)}"
        )


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


@app.command("elasticsearch-migrate")
def elasticsearch_migrate(
    delete_old: Annotated[
        bool, typer.Option(help="delete the shared indexes once copied (default: keep them)")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option(help="only list what would be copied; write and remove nothing")
    ] = False,
) -> None:
    """Copy every index of the old shared layout (one index per name for every tenant) into
    one index per tenant and name, then take the old aliases away. Run with no worker up."""
    from worker.adapters.elasticsearch import ElasticsearchBackend

    settings = _settings()
    if settings.search_backend != "elasticsearch":
        _stop("SIFT_SEARCH_BACKEND is not elasticsearch")
    backend = ElasticsearchBackend.from_settings(settings)
    try:
        report = backend.migrate_shared(delete_old=delete_old, dry_run=dry_run)
    except SiftError as error:
        _stop(plain(error), 1)
    verb = "would go" if dry_run else "went"
    for name, tenants in report.items():
        alias = f"{settings.elasticsearch_index_prefix}{name}"
        if not tenants:
            console.print(f"{alias}: holds no tenant's documents; left as it is")
            continue
        count = sum(tenants.values())
        console.print(f"{alias} -> {name}: {count} document(s) {verb} to {len(tenants)} tenant(s)")
    if not report:
        console.print("nothing to migrate: no index of the shared layout")


def _embedded_folder_alone(verb: str) -> tuple[Path, IO[str]]:
    """The workers' embedded data folder, and the lock that keeps every ``sift worker`` from
    it while it stays open; stops the command (nothing changed) if a stack or a worker on
    this host holds the folder, or it holds no index database."""
    from worker.adapters.embedded import DB_FILE

    settings = _settings()
    if settings.search_backend != "embedded":
        _stop(f"SIFT_SEARCH_BACKEND is not embedded: nothing to {verb}")
    data_dir = settings.data_dir.resolve()
    if not (data_dir / DB_FILE).is_file():  # opening it would make an empty one
        _stop(f"no embedded backend in {data_dir}: set SIFT_DATA_DIR to the workers' data folder")
    if holds_data_dir(data_dir):
        _stop(
            f"the data folder {data_dir} is in use by a running `sift up` stack: stop it "
            "(and every other worker on it) first; nothing was changed"
        )
    excluded = exclude_workers(data_dir)  # held to the end: no worker starts meanwhile
    if excluded is None:
        _stop(
            f"the data folder {data_dir} is in use by a running `sift worker` on this host: "
            "stop it (and every other worker on it) first; nothing was changed"
        )
    return data_dir, excluded


@app.command("embedded-upgrade")
def embedded_upgrade(
    yes: Annotated[bool, typer.Option("--yes", help="do not ask before upgrading")] = False,
) -> None:
    """Bring an embedded data folder written before each tenant's index had its own tables
    (schema v1, before edd94bb) to this release's schema v2, in place: documents, vectors,
    versions and the jobs queued in Redis are kept, nothing is embedded again. Run it with
    this release, every worker stopped (an earlier release's worker is not seen: stop those
    yourself): it refuses a folder a running `sift up` or `sift worker` on this host holds,
    and no worker starts while it runs. One transaction: a crash leaves the folder as it
    was."""
    import apsw

    from worker.adapters.embedded import EmbeddedBackend, upgrade_from_v1

    data_dir, excluded = _embedded_folder_alone("upgrade")
    try:
        if not yes:
            typer.confirm(
                f"Upgrade {data_dir} to embedded schema v2 in place? Every worker on it must "
                "be stopped, an earlier release's too",
                abort=True,
            )
        with console.status("making each tenant's index its own FTS5 table"):
            made = upgrade_from_v1(data_dir)
        backend = EmbeddedBackend(data_dir)
        try:
            backend.check()  # the tables that came after v2, as any v2 folder's first open
        finally:
            backend.close()
    except apsw.Error as error:
        _stop(f"nothing was changed: {error}", 1)
    except SiftError as error:
        _stop(plain(error), 1)
    finally:
        excluded.close()
    if made is None:
        console.print(f"{data_dir} is at embedded schema v2 already: nothing to do")
        return
    for tenant, index, rows in made:
        console.print(f"{plain(tenant)}/{plain(index)}: {rows} document(s)")
    console.print(f"{len(made)} tenant index(es) made; {data_dir} is at embedded schema v2")


@app.command("embedded-downgrade")
def embedded_downgrade(
    yes: Annotated[bool, typer.Option("--yes", help="do not ask before making them again")] = False,
) -> None:
    """Before rolling back to a release older than the erasing deletes (57bc511): make each
    embedded index's FTS5 table again as those releases made it, from its stored texts, so
    they can replace, delete and drop its documents. Run it with this release, every worker
    stopped: it refuses a folder a running `sift up` or `sift worker` on this host holds,
    and no worker starts while it runs. This release makes each table erasing again at its
    index's next write."""
    from worker.adapters.embedded import DB_FILE, EmbeddedBackend

    data_dir, excluded = _embedded_folder_alone("downgrade")
    if not yes:
        typer.confirm(
            f"Make every FTS5 table in {data_dir / DB_FILE} again as an earlier release's? "
            "Every worker on it must be stopped; this release's deletes stop erasing a "
            "document's terms at once until its index's next write",
            abort=True,
        )
    backend = EmbeddedBackend(data_dir)
    try:
        made = backend.make_earlier_fts()
    except SiftError as error:
        _stop(f"nothing was changed: {plain(error)}", 1)
    finally:
        backend.close()
        excluded.close()
    for tenant, index, rows in made:
        console.print(f"{plain(tenant)}/{plain(index)}: {rows} document(s)")
    console.print(
        f"{len(made)} FTS5 table(s) made as an earlier release's"
        + ("" if made else " (none was this release's)")
        + "; an earlier release can now replace, delete and drop their documents"
    )


# the option that sets each setting, where a command has one
SETTING_OPTIONS = {
    "gateway_port": "--port",
    "worker_metrics_port": "--metrics-port",
    "data_dir": "--data-dir",
    "worker_concurrency": "--concurrency",
    "worker_pool": "--pool",
    "worker_processes": "--processes",
    "log_level": "--loglevel",
}


def _settings(*, options: tuple[str, ...] = (), **overrides: Any) -> Settings:
    """The settings with ``overrides``; a bad one given by an option (a setting named in
    ``options``) is a usage error naming the option, not its variable, exit 2."""
    try:
        return load_settings(**overrides)
    except SiftError as error:
        given = {field: SETTING_OPTIONS[field] for field in options if field in overrides}
        if (named := option_error(error, given)) is not None:
            raise named from None
        _stop(plain(error))


def _dev_key(state: Path) -> dict[str, str]:
    """A development API key, kept in ``.sift/dev-api-key.json`` so it survives restarts."""
    path = state / DEV_KEY_FILE
    if path.exists():
        return dict(json.loads(path.read_text()))
    secret = base64.b64encode(secrets.token_bytes(24)).decode()
    key = {"key": f"sift-dev-{secrets.token_hex(12)}", "tenant": "dev",
           "webhook_secret": f"whsec_{secret}"}  # fmt: skip
    state.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(key) + "\n")
    path.chmod(0o600)
    return key


@dataclass(frozen=True)
class LocalStack:
    url: str
    api_key: str
    redis_url: str
    logs: Path
    supervisor: Supervisor | None = None


@contextlib.contextmanager
def local_stack(
    settings: Settings,
    report: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    on_refused: Callable[[Service], None] | None = None,
) -> Iterator[LocalStack]:
    """Redis (ours unless SIFT_REDIS_URL is set), one worker and the gateway, on
    ``SIFT_GATEWAY_PORT`` and ``SIFT_WORKER_METRICS_PORT``, keeping their files (the index,
    Redis's AOF, the logs) in ``SIFT_DATA_DIR``.

    It first claims the data folder (a lock file in it) and checks the two ports: another
    stack's are refused before anything is started or any log opened. With ``report``, a
    process that exits is started again (:class:`~worker.processes.stack.Supervisor`) and each
    restart is reported through it, but one that refused to start (exit 2) is left down and
    ``on_refused`` called with it, to stop the stack. Once ``cancel`` is set, a wait for a
    process to be ready raises :class:`~worker.processes.stack.StartInterrupted` (what was
    started is stopped)."""
    data_dir = settings.data_dir.resolve()
    gateway_port, metrics_port = settings.gateway_port, settings.worker_metrics_port
    with contextlib.ExitStack() as stack:
        described = f"pid {os.getpid()}, gateway port {gateway_port}"
        if metrics_port:
            described += f", worker metrics port {metrics_port}"
        stack.enter_context(claim_data_dir(data_dir, described))
        check_port_free(gateway_port, "gateway", "--port (SIFT_GATEWAY_PORT)")
        if metrics_port:  # the worker serves it on every interface
            check_port_free(metrics_port, "worker metrics", "--metrics-port "
                            "(SIFT_WORKER_METRICS_PORT)", host="0.0.0.0")  # fmt: skip
        api_key, extra = _api_key(settings, data_dir)
        extra["SIFT_DATA_DIR"] = str(data_dir)
        extra["SIFT_WORKER_METRICS_PORT"] = str(metrics_port)
        logs = data_dir / "logs"
        services: list[Service] = []
        supervisor = None if report is None else Supervisor(report, on_refused=on_refused)
        if supervisor is not None:  # ended last: the thread that starts the processes it
            stack.callback(supervisor.close)  # restarts, which follow it (Service.follow)
        redis_url = settings.redis_url
        if not redis_url:
            # its log with the others (it was in redis/, beside the AOF, the banner and
            # the README naming logs/); one left there by an earlier release moves too
            adopt_logs(data_dir / "redis" / "redis.log", logs / "redis.log")
            redis, url = redis_service(data_dir / "redis", appendonly=True, log=logs / "redis.log")
            redis.follow = True  # each process of the stack stops when sift up dies, even
            # SIGKILLed (it was left running, orphaned, its data folder's lock let go)
            stack.enter_context(running(redis, cancel))
            require_redis_7(redis, url)  # the machine's: apt's may be 6
            services.append(redis)
            redis_url = extra["SIFT_REDIS_URL"] = url + "/0"
        told = data_dir / STACK_REDIS_FILE  # for `sift status` (stack_redis_url)
        told.touch(mode=0o600)
        told.chmod(0o600)  # the URL may hold Redis's password, as the dev key file its secret
        told.write_text(redis_url + "\n")
        stack.callback(told.unlink, missing_ok=True)
        env = child_env(extra)
        worker_env = _own_metrics_folder(env, data_dir / "metrics" / "worker")
        # stopped within its own bound, even on a Redis that never answers (its processes'
        # warm shutdown hung on one, and a SIGKILL of their supervisor left them orphaned)
        workers = worker_service(logs, worker_env, processes=None)
        workers.stop_timeout = supervisor_stop_deadline(settings) + 5.0
        workers.follow = True
        services.append(stack.enter_context(running(workers, cancel)))
        gateway, url = gateway_service(
            logs, _own_metrics_folder(env, data_dir / "metrics" / "gateway"), port=gateway_port
        )
        gateway.follow = True
        services.append(stack.enter_context(running(gateway, cancel)))
        if supervisor is not None:
            for service in services:
                supervisor.watch(service)
            supervisor.start()
            stack.callback(supervisor.stop_watching)  # first: nothing restarts while stopping
        yield LocalStack(url, api_key, redis_url, logs, supervisor)


def _own_metrics_folder(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` with a multiprocess metrics folder of the child's own, if it has one at all,
    emptied: the stack starts from zero, as a worker does (the gateway never empties its
    folder, so every earlier run's files would pile up there, summed in).

    The worker and the gateway are two scrape targets: in one folder each ``/metrics`` summed
    the other's files too (every count twice in a sum over targets), and the worker, which
    empties its folder when it starts, deleted the gateway's live files when restarted."""
    from worker.observability.metrics import MULTIPROC_DIR_ENV

    if not env.get(MULTIPROC_DIR_ENV):
        return env
    shutil.rmtree(folder, ignore_errors=True)  # this stack's: it holds the data folder's lock
    folder.mkdir(parents=True)
    return {**env, MULTIPROC_DIR_ENV: str(folder)}


def _api_key(settings: Settings, data_dir: Path) -> tuple[str, dict[str, str]]:
    """The key the stack is called with, and the children's environment that accepts it."""
    keys = settings.all_api_keys()
    if not keys:
        dev = _dev_key(data_dir)
        return dev["key"], {"SIFT_API_KEYS": json.dumps([dev])}
    # a key given only as its digest cannot be presented: SIFT_API_KEY names one then
    api_key = next((k.key for k in keys if k.key), None) or settings.api_key
    if api_key is None:
        raise ConfigError(
            "the keys in SIFT_API_KEYS / SIFT_API_KEYS_FILE are all digests (key_sha256): "
            "set SIFT_API_KEY to one of the keys so the local stack can call the gateway"
        )
    return api_key, {}


def _start(
    stack: contextlib.ExitStack,
    settings: Settings,
    report: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    on_refused: Callable[[Service], None] | None = None,
) -> LocalStack:
    """Start the stack; a Ctrl-C while it starts (``cancel`` set) stops what was started and
    exits 130 with one line, not the log tail of a process that the Ctrl-C reached too. A
    refusal (a process's exit 2, or its own redis-server too old) is one line, exit 2, as a
    process's refusal once the stack runs: it exited 1 with the process's log tail."""
    try:
        with errors.status("starting redis, a worker and the gateway…"):  # stdout: the report
            return stack.enter_context(local_stack(settings, report, cancel, on_refused))
    except (RuntimeError, SiftError, StartInterrupted) as error:
        if cancel is not None and cancel.is_set():
            errors.print("interrupted while starting; every process stopped")
            raise typer.Exit(EXIT_INTERRUPTED) from error
        if isinstance(error, StartRefused):
            _stop(f"{plain(error)}; every process stopped")
        _stop(plain(error, lines=True), 1)  # a process's log tail: its lines kept


@app.command("up")
def up(
    port: Annotated[
        int | None, typer.Option(help=setting_help("the gateway's", "SIFT_GATEWAY_PORT"))
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help=setting_help("the worker's /metrics, 0: off", "SIFT_WORKER_METRICS_PORT")
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            parser=a_folder,
            help=setting_help("the index, Redis's AOF and the logs", "SIFT_DATA_DIR"),
        ),
    ] = None,
) -> None:
    """Run Redis, one worker and the gateway in the foreground until Ctrl-C, restarting any
    of them that exits. Refuses a port or data folder another stack uses."""
    overrides: dict[str, Any] = {}
    if port is not None:
        overrides["gateway_port"] = port
    if metrics_port is not None:
        overrides["worker_metrics_port"] = metrics_port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    settings = _settings(options=tuple(overrides), **overrides)
    if settings.worker_metrics_port and settings.worker_metrics_port == settings.gateway_port:
        # refused before anything starts: the worker's metrics took the port, and the
        # gateway's failure to bind it was the only word of it
        _stop(
            f"--port (SIFT_GATEWAY_PORT) and --metrics-port (SIFT_WORKER_METRICS_PORT) are "
            f"both {settings.gateway_port}: the gateway and the worker's /metrics need one each"
        )
    # a Redis of its own choosing, waited for as its worker would; sift up's own (no
    # SIFT_REDIS_URL) has db 0, every channel, noeviction and the AOF: nothing to check
    _check_redis_at_start(settings, worker=True)
    stopping = threading.Event()
    started: LocalStack | None = None
    refused: list[Service] = []  # a process that refused to start: the stack stops, exit 2

    def on_signal(*_: object) -> None:
        stopping.set()
        if started is not None and started.supervisor is not None:
            started.supervisor.stop_watching()  # Ctrl-C reached the processes too

    def on_refused(service: Service) -> None:
        refused.append(service)
        on_signal()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    with contextlib.ExitStack() as stack:
        started = _start(
            stack,
            settings,
            # a process exited, restarted: status, on stderr with the errors (stdout: the report)
            report=lambda line: errors.print(f"[yellow]{plain(line)}[/]"),
            cancel=stopping,
            on_refused=on_refused,
        )
        console.print(f"gateway  [bold]{started.url}[/]  (OpenAPI at {started.url}/docs)")
        console.print(f"api key  [bold]{started.api_key}[/]")
        console.print(f"webhooks signed with {_webhook_secret_source(settings)}", soft_wrap=True)
        console.print(f"redis    {started.redis_url}")
        console.print(f"logs     {started.logs}")
        # one line however narrow the terminal, so that it pastes as one command; with the
        # data folder, by which `sift status` and `sift tenant purge` find this stack's Redis
        # (without it they read the stack on .sift/data under the shell's folder, another one)
        folder = shlex.quote(str(settings.data_dir.resolve()))
        export = f"export SIFT_URL={started.url} SIFT_API_KEY={started.api_key}"
        export += f" SIFT_DATA_DIR={folder}"
        console.print(f"\n{export}", soft_wrap=True)
        console.print("Ctrl-C stops everything.")
        stopping.wait()
        errors.print("stopping…")
    if refused:  # said once the stack has stopped, as the last line
        why = refused[0].refusal() or "its log's error line"
        _stop(f"{refused[0].name} refused to start ({why}); every process stopped")


def _webhook_secret_source(settings: Settings) -> str:
    """Where the secret that signs this stack's webhooks is, to verify them with."""
    if settings.all_api_keys():
        return "the key's webhook_secret in SIFT_API_KEYS / SIFT_API_KEYS_FILE"
    path = settings.data_dir.resolve() / DEV_KEY_FILE
    return f'the "webhook_secret" in {path} (the development key\'s)'


# The SIFT_ variables ``sift demo`` takes from its environment: those that choose the rerank
# and its model, so that it can show one. Every other (the backend and its URL, Redis, the
# data folder, the keys, the ports, ...) places a deployment, and the demo runs on the defaults.
DEMO_KEEPS = ("SIFT_GENERATION_", "SIFT_RERANK_", "SIFT_PRICES")


@contextlib.contextmanager
def _demo_environment() -> Iterator[None]:
    """This process's environment without a deployment's ``SIFT_`` variables (all but
    :data:`DEMO_KEEPS`'s) while the demo runs, for its settings and the stack and steps it
    starts: an operator's shell (a sourced ``deploy/.env``) gave it the deployment's, and its
    worker indexed the sample into the deployment's Elasticsearch, or waited on one that did
    not answer. Put back after, as they were."""
    dropped = {
        name: value
        for name, value in os.environ.items()
        if name.startswith("SIFT_") and not name.startswith(DEMO_KEEPS)
    }
    for name in dropped:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(dropped)


@app.command("demo")
def demo(
    limit: Annotated[int, typer.Option(min=1, max=100, help="hits shown per query")] = 3,
    yes: Annotated[
        bool, typer.Option("--yes", help="rerank at a paid model without asking first")
    ] = False,
) -> None:
    """The whole path on this machine: start the stack, ingest the bundled sample corpus,
    run a batch of searches through the gateway and the queue, print them, stop.

    It runs on the defaults whatever the environment says, never on a deployment: the
    embedded backend in a temporary folder, a Redis, ports and a development key of its
    own. Of the SIFT_ variables it takes only those choosing the rerank and its model
    (SIFT_GENERATION_*, SIFT_RERANK_*, SIFT_PRICES; with ANTHROPIC_API_KEY). When they
    make its searches rerank at a paid model, it says so and asks first (--yes: it does not
    ask)."""
    with _demo_environment():
        _ask_before_paid_calls(sample_path("sample_queries.jsonl"), yes)
        _demo(limit)


def _ask_before_paid_calls(queries: Path, yes: bool) -> None:
    """Say before anything starts that the demo's searches make paid model calls, and ask,
    unless ``yes``. With a model, a key and SIFT_RERANK_ENABLED in the shell (a sourced
    deploy/.env), each search reranked at the provider's cost and nothing said so. No answer
    (stdin at its end: no one to ask) is a no. Calls to this machine (a fake) are not asked."""
    settings = _settings()
    model = settings.generation_model_id
    if not settings.rerank_enabled or model is None:
        return
    from worker.adapters.anthropic import paid_destination

    where = paid_destination()
    if where is None:
        return
    searches = sum(1 for line in queries.read_text().splitlines() if line.strip())
    most = searches * settings.generation_max_requests
    retries = f" (up to {most} with retries)" if most > searches else ""
    errors.print(
        f"sift demo reranks each of its {searches} searches with {model} at {where}: "
        f"about {searches} paid calls{retries}",
        soft_wrap=True,
    )
    if yes:
        return
    try:
        confirmed = typer.confirm("Make them?", default=False, err=True)
    except typer.Abort:  # stdin at its end
        confirmed = False
    if not confirmed:
        errors.print("nothing was started; --yes makes them without asking")
        raise typer.Exit(1)


def _demo(limit: int) -> None:
    started = time.monotonic()
    corpus, queries = sample_path("sample_corpus.jsonl"), sample_path("sample_queries.jsonl")
    stopping = threading.Event()
    steps = _Steps(stopping)

    def on_signal(*_: object) -> None:
        stopping.set()  # the step running, then the stack, stop; nothing raised from here
        steps.stop_current()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    failed = total = 0
    try:
        with (
            tempfile.TemporaryDirectory(prefix="sift-demo-") as tmp,
            contextlib.ExitStack() as stack,
        ):
            # a Redis of its own always (SIFT_REDIS_URL is dropped too): on an exported one
            # (an operator's shell) its worker took the deployment's searches, and the
            # deployment's its own
            settings = _settings(data_dir=Path(tmp), gateway_port=free_port(),
                                 worker_metrics_port=free_port(), redis_url=None)  # fmt: skip
            local = _start(stack, settings, cancel=stopping)
            console.print(f"stack up at {local.url}")
            env = child_env({"SIFT_URL": local.url, "SIFT_API_KEY": local.api_key})
            out = Path(tmp) / "results.jsonl"
            steps.run("the ingest", sift_command("ingest", str(corpus), "--index", "demo"), env)
            steps.run("the batch", sift_command("batch", str(queries), "--index", "demo",
                                                "--out", str(out), "--limit", str(limit)),
                      env)  # fmt: skip
            failed, total = _print_demo_results(queries, out)
            errors.print("stopping the stack…")  # status, on stderr: stdout holds the hits
    except _Interrupted as interrupted:
        errors.print(f"interrupted during {interrupted.step}: it and the stack were stopped; "
                     "every process stopped")  # fmt: skip
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if stopping.is_set():  # while the results printed or the stack stopped
        errors.print("interrupted; every process stopped")
        raise typer.Exit(EXIT_INTERRUPTED)
    if failed:
        console.print(f"[red]{failed} of {total} queries failed[/]; every process stopped")
        raise typer.Exit(EXIT_ITEMS_FAILED)
    elapsed = time.monotonic() - started
    console.print(f"[green]demo done[/] in {elapsed:.1f} s; every process stopped")


class _Interrupted(Exception):
    def __init__(self, step: str) -> None:
        super().__init__(step)
        self.step = step


class _Steps:
    """``sift demo``'s steps, each a ``sift`` command run to its end. Each runs in a process
    group of its own: the terminal's Ctrl-C reaches only the demo, which stops the step
    (SIGTERM: a Ctrl-C reaching it during its imports printed a traceback) and the stack."""

    def __init__(self, stopping: threading.Event) -> None:
        self.stopping = stopping
        self.current: subprocess.Popen[bytes] | None = None

    def run(self, step: str, command: list[str], env: dict[str, str]) -> None:
        """Run ``command``; raise :class:`_Interrupted` naming ``step`` if the demo is
        stopping, or exit with its status if it failed."""
        if self.stopping.is_set():
            raise _Interrupted(step)
        self.current = proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, process_group=0
        )
        if self.stopping.is_set():  # a signal before ``current`` was set
            self.stop_current()
        returncode = proc.wait()
        self.current = None
        if self.stopping.is_set():
            raise _Interrupted(step)
        if returncode != 0:
            errors.print(f"[red]{' '.join(command[3:5])} failed[/] (exit {returncode})")
            raise typer.Exit(returncode)

    def stop_current(self) -> None:
        proc = self.current
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()


def _print_demo_results(queries: Path, out: Path) -> tuple[int, int]:
    """Print the batch's results; answers how many failed, of how many."""
    lines = queries.read_text().splitlines()
    texts = {row["id"]: row["query"] for row in map(json.loads, lines)}
    items = [json.loads(line) for line in out.read_text().splitlines()]
    for item in items:
        if item["status"] == "succeeded":
            title = f"“{plain(texts.get(item['query_id'], item['query_id']))}”"
            print_result(console, item["result"], title=title)
        else:
            error = item.get("error") or {}
            console.print(f"[red]{plain(item['query_id'])} {item['status']}[/]: "
                          f"{plain(error.get('type'))}: {plain(error.get('message'))}")  # fmt: skip
    return sum(item["status"] != "succeeded" for item in items), len(items)
