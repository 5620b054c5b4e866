"""``sift elasticsearch-migrate``, ``sift embedded-upgrade`` and ``sift embedded-downgrade``:
bringing stored indexes to or from this release's layout, every worker stopped."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Annotated

import typer
from rich.console import Console

from worker.cli._app import app
from worker.cli._common import cli_settings, stop
from worker.cli._output import plain
from worker.errors import SiftError
from worker.processes.folder_locks import exclude_workers, holds_data_dir

console = Console(emoji=False)
errors = Console(emoji=False, stderr=True)


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

    settings = cli_settings()
    if settings.search_backend != "elasticsearch":
        stop("SIFT_SEARCH_BACKEND is not elasticsearch")
    backend = ElasticsearchBackend.from_settings(settings)
    try:
        report = backend.migrate_shared(delete_old=delete_old, dry_run=dry_run)
    except SiftError as error:
        stop(plain(error), 1)
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

    settings = cli_settings()
    if settings.search_backend != "embedded":
        stop(f"SIFT_SEARCH_BACKEND is not embedded: nothing to {verb}")
    data_dir = settings.data_dir.resolve()
    if not (data_dir / DB_FILE).is_file():  # opening it would make an empty one
        stop(f"no embedded backend in {data_dir}: set SIFT_DATA_DIR to the workers' data folder")
    if holds_data_dir(data_dir):
        stop(
            f"the data folder {data_dir} is in use by a running `sift up` stack: stop it "
            "(and every other worker on it) first; nothing was changed"
        )
    excluded = exclude_workers(data_dir)  # held to the end: no worker starts meanwhile
    if excluded is None:
        stop(
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
        stop(f"nothing was changed: {error}", 1)
    except SiftError as error:
        stop(plain(error), 1)
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
        stop(f"nothing was changed: {plain(error)}", 1)
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
