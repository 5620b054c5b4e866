"""``sift tenant purge NAME``: erase a removed tenant, its jobs, results and indexes.

    SIFT_REDIS_URL=redis://127.0.0.1:6379/0 sift tenant purge acme [--yes] [--force]

An operator's command, like ``sift status``: it reads Redis (``SIFT_REDIS_URL``, or the
``sift up`` stack on ``SIFT_DATA_DIR``) and the configured search backend (the embedded one
on ``SIFT_DATA_DIR``, or Elasticsearch) directly, with no API key. Removing a tenant's keys
stops its requests and the workers run none of its queued work (``tenant_removed``), but
erases nothing: its results, queries and documents stay until their retention ends (the
documents for good), and a tenant given the same name later inherits them. This erases them:

1. every job of the tenant not final yet is canceled, as a cancel does (the counts of queued
   and running work move; a batch item a worker runs stops before its model call), and an
   economy batch's provider batches not ended are canceled at the provider, as the batch's
   cancel task does: its economy state, which names them, is about to be deleted, and nothing
   could cancel them after (they would run to their end, billed). A provider that does not
   answer a cancel (or no ``SIFT_GENERATION_MODEL`` to ask it with) stops the purge there,
   exit 1, before anything is erased: the state that names them stays, so running it again
   cancels them then. A create whose answer was lost may have made a provider batch that is
   not canceled (its candidates may be other clients'): each candidate, and each such create
   not looked for yet (when it was made, its size), is printed for an operator to look for.
   The provider batches Sift made (not those candidates) are handed to the workers to delete
   at the provider once ended (``sift.economy_delete``, as an erase does): the provider keeps
   their requests and results, the queries and candidates' text, 29 days;
2. each of its indexes is dropped through the backend's own drop (a write version taken as
   the gateway's drop takes one, so the floor it leaves makes a write accepted before it
   land nothing), on Elasticsearch those holding no document too (not listed, but still
   indexes of the tenant's, until deleted), its own settings with it (on the embedded
   backend, a data folder with no database, or not the one the live workers on its Redis
   serve, stops the purge before it starts: it is not the workers' folder); and so is each
   index one of its ingest or delete jobs that no worker ended names, holding a document or
   not: an ingest into a new index a worker was running went on to write every document
   after the purge, the index having no floor;
3. every Redis key that names the tenant or one of its jobs is deleted
   (:mod:`worker.queue.jobstore.tenants` lists the families), and Redis is asked to rewrite
   its files, whose AOF still holds the writes of what went (at most once every
   ``REWRITE_INTERVAL_SECONDS``: one held back is asked for by a worker when the interval
   ends, the task ``sift.rewrite_owed`` sent then, and by the re-drive's sweep,
   :mod:`worker.queue.jobstore.rewrite`); a line says which.

It prints what it removed, by kind. Everything is found afresh, so a second run removes
nothing, and says that nothing of the tenant was found, exit 0, asking for no rewrite, as it
does of a name nothing holds (a typo): all-zero counts under "purged" read as an erasure done.
It refuses a tenant that still has a key in the settings, or, when it found Redis through the
``sift up`` stack on ``SIFT_DATA_DIR``, the tenant of that stack's development key (``--force``
to erase it anyway: its clients may still be writing), and asks before it starts (``--yes`` not
to).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, cast

import redis
import typer
from rich.table import Table

from worker.cli._app import app
from worker.cli._common import DEV_KEY_FILE, EXIT_ERROR, cli_settings, stack_redis_url, stop
from worker.cli._output import cli_console, plain
from worker.constants import (
    ECONOMY_DELETE_TASK,
    REWRITE_INTERVAL_SECONDS,
    REWRITE_TASK,
    SEARCH_QUEUE,
)
from worker.core.ports import IndexCatalog
from worker.errors import ConfigError, SiftError
from worker.queue import data_folder
from worker.queue.jobstore import JobStore, Rewrite, TenantJobs, owe_rewrite
from worker.queue.jobstore.jobindex import KIND_BATCH
from worker.queue.jobstore.rewrite import schedule_payment
from worker.redis_client import CONNECTION_OPTIONS
from worker.settings import TENANT_PATTERN, Settings
from worker.write_versions import next_write_version

tenant_app = typer.Typer(help="Erase a removed tenant's data (an operator's command).")
app.add_typer(tenant_app, name="tenant")


def _tenant_name(value: str) -> str:
    """A tenant's name as the keys file allows it: no other (a ``*`` would make the Redis
    patterns match every tenant's keys)."""
    if not re.fullmatch(TENANT_PATTERN, value):
        raise typer.BadParameter(f"letters, digits, '_', '.' and '-' only, not {value!r}")
    return value


def _drop_indexes(
    settings: Settings, client: redis.Redis, tenant: str, written: set[str]
) -> Counter[str]:
    """Drop each of the tenant's indexes in the configured backend, as a drop job does
    (:func:`worker.queue.lifecycle.drop`), and each index ``written`` names (those its
    unfinished writes target, :meth:`~worker.queue.jobstore.JobStore.unfinished_write_indexes`):
    one holding no document yet gets its floor all the same, so the write a worker is
    running lands nothing after the purge. Answers the indexes and documents dropped, and
    the indexes only ``written`` named (``closed``)."""
    from worker.adapters.index_settings import IndexSettingsStore
    from worker.queue.lifecycle import drop
    from worker.runtime.bootstrap import build_backend

    backend: Any = build_backend(settings)
    # the index's own settings go with it, as with a drop job (none kept: nothing to clear)
    store = IndexSettingsStore(backend, client) if hasattr(backend, "store_settings") else None
    dropped: Counter[str] = Counter()
    try:
        catalog = cast(IndexCatalog, backend)
        names = {index.name for index in catalog.indexes(tenant)}
        # Elasticsearch keeps an index the tenant's documents all left (not listed) until
        # it is deleted: its shard, and their data on disk until its segments merge
        empty = getattr(backend, "empty_indexes", None)
        if callable(empty):
            names |= set(empty(tenant))
        for name in sorted(names | written):
            version = next_write_version(client, tenant)
            dropped["documents"] += drop(catalog, store, name, tenant, version)
            dropped["indexes" if name in names else "closed"] += 1
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
    return dropped


def _name_creates_in_doubt(store: JobStore, jobs: TenantJobs) -> int:
    """Print what the purge leaves at the provider of the tenant's creates whose answer was
    lost (:func:`~worker.queue.economy.cancel.creates_in_doubt`): each candidate, not
    canceled (it may be another client's), and each create not looked for yet, with when it
    was made and its size, for an operator to look for at the provider. Answers how many
    candidates were left."""
    from worker.queue.economy.cancel import creates_in_doubt

    console, left = cli_console(), 0
    for batch_id in jobs.ids.get(KIND_BATCH, []):
        candidates, unsought = creates_in_doubt(store, batch_id)
        for provider_id in candidates:
            console.print(
                f"batch {batch_id}: provider batch {provider_id} not canceled: a candidate of a "
                "create whose answer was lost (it may be another client's); if it is this "
                "tenant's, it runs to its end (then a worker deletes it)",
                soft_wrap=True,
            )
        left += len(candidates)
        for submission, (at, requests) in unsought.items():
            made = datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
            console.print(
                f"batch {batch_id}: create {submission} of {requests} request(s), made at {made}, "
                "has no answer kept: a provider batch it made, if any, is not canceled here (its "
                "submission cancels it if the answer still comes; if it was lost, look for one "
                f"of {requests} request(s) created then)",
                soft_wrap=True,
            )
    return left


def _cancel_provider_batches(settings: Settings, store: JobStore, jobs: TenantJobs) -> int:
    """Cancel, at the provider, each of the tenant's economy batches' provider batches that
    has not ended (:func:`~worker.queue.economy.cancel.open_provider_batches`), printing
    each; stop the purge, nothing erased yet, naming each one whose cancel failed. Answers
    how many were canceled."""
    from worker.queue.economy.cancel import open_provider_batches
    from worker.runtime.bootstrap import build_batch_client

    held = [
        (batch_id, provider_id)
        for batch_id in jobs.ids.get(KIND_BATCH, [])
        for provider_id in open_provider_batches(store, batch_id)
    ]
    if not held:
        return 0
    client = build_batch_client(settings)
    if client is None:
        stop(
            f"{len(held)} provider batch(es) of the tenant's economy batches still run "
            f"({', '.join(p for _, p in held)}), and SIFT_GENERATION_MODEL is not set to cancel "
            "them with: set it (and the provider's key) as the workers have it, and run the "
            "purge again (its jobs were canceled; nothing was erased)",
            EXIT_ERROR,
        )
    failed = []
    for batch_id, provider_id in held:
        try:
            client.cancel(provider_id)
        except SiftError as exc:
            failed.append(f"{provider_id} (batch {batch_id}): {plain(exc)}")
            continue
        cli_console().print(f"batch {batch_id}: provider batch {provider_id} canceled")
    if failed:
        stop(
            "the provider did not cancel " + "; ".join(failed) + ". Run the purge again to "
            "cancel them and finish (its jobs were canceled; nothing was erased)",
            EXIT_ERROR,
        )
    return len(held)


def _delete_provider_batches(settings: Settings, store: JobStore, jobs: TenantJobs) -> int:
    """Hand the tenant's economy batches' provider batches (those Sift made and recorded; not
    a create in doubt's candidates, each maybe another client's, but those proved ours) to
    the workers, to delete at the provider (``sift.economy_delete``, as an erase of the batch
    does), with the candidates not judged yet, which the task judges once they end (deleted
    if their results prove them the tenant's): the provider keeps their requests and results,
    queries and candidates' text, 29 days, and the state naming them is about to be deleted.
    A worker, not this command: one canceled just now is canceling, and the provider deletes
    an ended batch only. Answers how many were handed to delete (not the candidates)."""
    from celery import Celery

    from worker.queue.config import celery_config

    kept = {b: store.keep_provider_deletions(b) for b in jobs.ids.get(KIND_BATCH, [])}
    judged = {b: list(store.provider_candidates(b)) for b in kept}
    kept = {batch_id: ids for batch_id, ids in kept.items() if ids or judged[batch_id]}
    if not kept:
        return 0
    celery = Celery("sift-purge", set_as_current=False)
    celery.config_from_object(celery_config(settings))
    try:
        for batch_id, ids in kept.items():
            celery.send_task(ECONOMY_DELETE_TASK, args=[batch_id], queue=SEARCH_QUEUE)
            if ids:
                cli_console().print(
                    f"batch {batch_id}: provider batch(es) {', '.join(ids)} to be deleted at "
                    "the provider by a worker"
                )
            if judged[batch_id]:
                cli_console().print(
                    f"batch {batch_id}: candidate(s) {', '.join(judged[batch_id])} to be "
                    "judged by a worker once they end, and deleted at the provider if their "
                    "results prove them this tenant's"
                )
    finally:
        celery.close()
    return sum(len(ids) for ids in kept.values())


def _stack_dev_tenant(data_dir: Path) -> str | None:
    """The tenant of the development key ``sift up`` keeps in ``data_dir``, if it keeps one:
    the stack's children accept it though no setting of this command's names it."""
    try:
        return str(json.loads((data_dir / DEV_KEY_FILE).read_text())["tenant"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _embedded_exists(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds an embedded backend's database. Opening one creates it: a
    purge run without the workers' SIFT_DATA_DIR made an empty one, dropped its 0 indexes and
    went on to delete every Redis record, the tenant's documents left where they were."""
    from worker.adapters.embedded import DB_FILE

    return (data_dir / DB_FILE).is_file()


def _require_served_folder(client: redis.Redis, data_dir: Path) -> None:
    """Stop (exit 1, nothing erased) a purge whose ``data_dir`` is not the folder the live
    workers on its Redis serve (:mod:`worker.queue.data_folder`): it would drop the tenant's
    indexes there, none, delete every Redis record and exit 0, the documents left in the
    workers' folder for the next tenant given the name to search. With no live worker, no
    folder is named in Redis and this cannot tell."""
    live = data_folder.served(client)
    if live is not None and live.id != data_folder.stored_id(data_dir.resolve()):
        stop(
            f"SIFT_DATA_DIR ({data_dir.resolve()}) is not the data folder the live workers on "
            f"this Redis serve ({plain(live.where)}): set SIFT_DATA_DIR to that folder "
            "(nothing was erased)",
            EXIT_ERROR,
        )


def _where(settings: Settings) -> str:
    if settings.search_backend == "elasticsearch":
        return f"elasticsearch at {settings.elasticsearch_url}"
    return f"the embedded backend in {settings.data_dir.resolve()}"


@tenant_app.command("purge")
def purge(
    name: Annotated[str, typer.Argument(callback=_tenant_name, help="the tenant to erase")],
    yes: Annotated[bool, typer.Option("--yes", help="do not ask before erasing")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="erase a tenant that still has an API key")
    ] = False,
) -> None:
    """Cancel a removed tenant's jobs, drop its indexes, and delete every record of it in
    Redis (SIFT_REDIS_URL, or the sift up stack on SIFT_DATA_DIR); prints what went."""
    settings = cli_settings()
    try:
        keys = settings.all_api_keys()
    except ConfigError as exc:
        stop(plain(exc.message), EXIT_ERROR)
    url = settings.redis_url or stack_redis_url(settings.data_dir.resolve())
    if not url:
        stop("SIFT_REDIS_URL is not set, and no `sift up` stack runs on SIFT_DATA_DIR", EXIT_ERROR)
    dev = None if settings.redis_url else _stack_dev_tenant(settings.data_dir.resolve())
    settings = settings.model_copy(update={"redis_url": url})
    if name == dev and not force:
        stop(
            f"tenant {name!r} still has a key: the `sift up` stack on SIFT_DATA_DIR serves it "
            f"with its development key ({settings.data_dir.resolve() / DEV_KEY_FILE}); stop "
            "the stack and delete that file first (or pass --force)",
            EXIT_ERROR,
        )
    if any(key.tenant == name for key in keys) and not force:
        stop(
            f"tenant {name!r} still has a key in SIFT_API_KEYS / SIFT_API_KEYS_FILE: remove its "
            "entries and restart the gateways and workers first (or pass --force)",
            EXIT_ERROR,
        )
    if settings.search_backend != "elasticsearch" and not _embedded_exists(settings.data_dir):
        stop(
            f"no embedded backend in {settings.data_dir.resolve()}: set SIFT_DATA_DIR to the "
            "workers' data folder (nothing was erased)",
            EXIT_ERROR,
        )
    if not yes:
        typer.confirm(
            f"Erase tenant {name!r}: cancel its jobs, delete its records in Redis and drop "
            f"its indexes in {_where(settings)}? This cannot be undone",
            abort=True,
        )
    client = redis.Redis.from_url(url, **CONNECTION_OPTIONS)
    store = JobStore(client, result_ttl=settings.result_retention_seconds)
    try:
        if settings.search_backend != "elasticsearch":
            _require_served_folder(client, settings.data_dir)
        jobs = store.tenant_jobs(name)
        canceled = store.cancel_tenant_jobs(jobs)
        canceled["provider batch"] = _cancel_provider_batches(settings, store, jobs)
        canceled["in doubt"] = _name_creates_in_doubt(store, jobs)
        canceled["provider deletes"] = _delete_provider_batches(settings, store, jobs)
        dropped = _drop_indexes(settings, client, name, store.unfinished_write_indexes(jobs))
        deleted = store.delete_tenant_jobs(jobs) + store.delete_tenant_keys(name)
        found = any(n > 0 for n in (*canceled.values(), *dropped.values(), *deleted.values()))
        if found:
            owe_rewrite(client)  # Redis's AOF still holds the writes of what went
            rewrite = store.rewrite_files()
            if rewrite in (Rewrite.LATCHED, Rewrite.BUSY):
                _schedule_rewrite(settings, client)
    except (redis.RedisError, OSError, SiftError) as exc:
        stop(f"purge of {name!r} stopped (run it again to finish): {plain(exc)}", EXIT_ERROR)
    finally:
        store.close()
    if not found:  # a name mistyped, or a tenant purged already: exit 0 all the same
        cli_console().print(
            f"tenant {name!r}: nothing of it was found (no job, record or index in Redis or "
            f"{_where(settings)}); nothing was erased, and no rewrite was asked",
            soft_wrap=True,
        )
        return
    _show(name, canceled, dropped, deleted)
    cli_console().print(_REWRITES[rewrite], soft_wrap=True)


def _schedule_rewrite(settings: Settings, client: redis.Redis) -> None:
    """Have a worker ask the rewrite the latch held back, or a rewrite running, once the
    latch expires (``sift.rewrite_owed``, as an erase does): with the re-drive off no sweep
    would, and the purged text stayed in the AOF until the next erase past the interval."""
    from celery import Celery

    from worker.queue.config import celery_config

    celery = Celery("sift-purge", set_as_current=False)
    celery.config_from_object(celery_config(settings))
    try:
        schedule_payment(client, lambda due: celery.send_task(
            REWRITE_TASK, queue=SEARCH_QUEUE, countdown=due, ignore_result=True
        ))  # fmt: skip
    finally:
        celery.close()


_REWRITES = {
    Rewrite.STARTED: "Redis was asked to rewrite its files (AOF, RDB): the erased text leaves "
    "its disk once the rewrite ends",
    Rewrite.LATCHED: "Redis was asked to rewrite its files within the last "
    f"{REWRITE_INTERVAL_SECONDS} s: a worker asks it again once they have passed "
    "(sift.rewrite_owed, sent now)",
    Rewrite.BUSY: "Redis was rewriting its files already: a worker asks it again in "
    f"{REWRITE_INTERVAL_SECONDS} s (sift.rewrite_owed, sent now)",
    Rewrite.NO_FILES: "Redis keeps no AOF and no RDB snapshots: nothing of it on its disk",
    Rewrite.REFUSED: "Redis refused to rewrite its files (BGREWRITEAOF, BGSAVE): its AOF or "
    "RDB keeps the erased text until it rewrites them itself",
    Rewrite.FAILED: "Redis was not asked to rewrite its files (it did not answer): a worker's "
    "re-drive sweep asks it",
    Rewrite.NOT_OWED: "Redis was asked to rewrite its files by another process just now",
}


# the kinds the job store's purge counts, as the table names them
_DELETED_ROWS = {
    "search": "searches deleted",
    "batch": "batches deleted",
    "ingest": "ingests deleted",
    "keys": "their Redis keys and set entries deleted",
    "job lists": "job lists deleted",
    "idempotency keys": "idempotency keys deleted",
    "index settings": "index settings deleted (an earlier release's)",
    "write version": "write-version counters deleted",
    "erasure marks": "marks of jobs it erased deleted",
}


def _show(
    tenant: str, canceled: Counter[str], dropped: Counter[str], deleted: Counter[str]
) -> None:
    rows = [
        ("searches canceled", canceled["search"]),
        ("ingests canceled", canceled["ingest"]),
        ("batch items canceled", canceled["batch_item"]),
        ("provider batches canceled (economy lane)", canceled["provider batch"]),
        ("provider batches of creates in doubt, not canceled", canceled["in doubt"]),
        ("provider batches handed to a worker to delete", canceled["provider deletes"]),
        ("indexes dropped", dropped["indexes"]),
        ("indexes only its unfinished writes named, closed to them", dropped["closed"]),
        ("documents dropped", dropped["documents"]),
    ]
    rows += [(what, deleted[kind]) for kind, what in _DELETED_ROWS.items()]
    # any other kind the job store counted (the index sizes), by its own name
    rows += [
        (f"{kind} deleted", n) for kind, n in sorted(deleted.items()) if kind not in _DELETED_ROWS
    ]
    table = Table(title=f"tenant {tenant}: purged")
    table.add_column("what")
    table.add_column("removed", justify="right")
    for what, count in rows:
        table.add_row(what, str(count))
    cli_console().print(table)
