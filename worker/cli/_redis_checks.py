"""The checks of the Redis a gateway, a worker or ``sift up`` starts on: it is set, it answers
(waited for), and it is one they can run on."""

from __future__ import annotations

import time
from typing import Any

import typer
from rich.console import Console

from worker.cli._common import (
    sigterm_as_ctrl_c,
    stop,
)
from worker.cli._output import plain
from worker.settings import Settings

console = Console(emoji=False)
errors = Console(emoji=False, stderr=True)


def require_redis(settings: Settings, what: str) -> None:
    """Stop (exit 2, one line) a gateway or worker with no Redis to share, before it starts:
    the worker's processes each died on it and were started again for as long as it ran."""
    if not settings.redis_url:
        stop(
            f"SIFT_REDIS_URL is required to run {what}: the Redis the gateways and workers "
            "share (`sift up` runs one of its own)"
        )


#: The pauses between a gateway's or worker's tries of a Redis not answering yet: soon at first
#: (pods starting together), then every few seconds for as long as it takes, as Celery's broker
START_WAIT_PAUSES = (0.5, 1.0, 2.0, 5.0)


def redis_answers(settings: Settings) -> bool:
    """Whether the Redis of ``SIFT_REDIS_URL`` answers now (one ``PING``)."""
    from worker.redis_client import unanswered

    url = settings.redis_url
    return url is not None and not unanswered(url)


def check_redis_at_start(settings: Settings, *, worker: bool) -> None:
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
        stop(f"SIFT_REDIS_URL: Redis refuses {why} ({refusal}){hint}")


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
        stop(
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
        stop(
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
        stop(
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
