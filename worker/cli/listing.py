"""``sift searches``, ``sift batches`` and ``sift ingestions``: the caller's jobs, newest first,
through the gateway (``GET /v1/searches`` and the others; ``SIFT_URL``, ``SIFT_API_KEY``).

    sift batches --status running
    sift searches --limit 100 --json
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import islice
from typing import Annotated, Any

import typer

from worker.cli._app import app
from worker.cli._common import _expected_errors, _out, one_of
from worker.cli._http import Gateway, gateway
from worker.cli._output import counted, local_time, plain, print_fitted
from worker.constants import MAX_PAGE_SIZE
from worker.contract import JobStatus

STATUSES = tuple(status.value for status in JobStatus)
MAX_PAGES = 1_000  # a filter that matches nothing stops after this many pages

Status = Annotated[
    str | None,
    typer.Option(
        "--status",
        callback=one_of(STATUSES),
        help=f"only jobs in this status: {', '.join(STATUSES)}",
    ),
]
Limit = Annotated[int, typer.Option("--limit", min=1, help="show at most this many (newest)")]
JsonOut = Annotated[bool, typer.Option("--json", help="print the jobs as a JSON array")]


def fetch_jobs(
    client: Gateway, path: str, key: str, status: str | None, limit: int
) -> tuple[list[Any], bool]:
    """Up to ``limit`` jobs from a list route, newest first, page after page: a filtered
    page can be short (the gateway bounds each request's scan), so it goes on by the token.
    Answers them and whether more are left: one more than ``limit`` is asked for, and "more"
    is a job seen past the limit (or a scan cut at :data:`MAX_PAGES` with a token left), not
    a token alone: a filtered page that fills up carries one though nothing may match past
    it, and exactly ``limit`` matches said "more follow" before an empty last page."""
    params: dict[str, Any] = {"page_size": min(limit + 1, MAX_PAGE_SIZE)}
    if status is not None:
        params["status"] = status
    jobs: list[Any] = []
    left = False
    for page in islice(client.pages(path, params, key), MAX_PAGES):
        jobs.extend(page[key])
        left = bool(page.get("next_page_token"))
        if len(jobs) > limit:
            break
    return jobs[:limit], len(jobs) > limit or left


def _status(value: Any) -> str:
    colour = {"succeeded": "green", "failed": "red", "canceled": "yellow", "running": "cyan"}
    name = str(value)
    return f"[{colour[name]}]{name}[/]" if name in colour else plain(name)


def _list(
    path: str,
    key: str,
    one: str,
    status: str | None,
    limit: int,
    json_out: bool,
    columns: list[str],
    row: Callable[[dict[str, Any]], list[str]],
    drop_order: list[str],
) -> None:
    console = _out()
    with _expected_errors(), gateway() as client:
        jobs, more = fetch_jobs(client, path, key, status, limit)
    if json_out:
        typer.echo(json.dumps(jobs))
        return
    prefix = "" if status is None else f"{status} "
    print_fitted(
        console,
        f"{counted(len(jobs), prefix + one, prefix + key)}, newest first",
        columns,
        [row(job) for job in jobs],
        drop_order=drop_order,
        wrapped=("query", "error"),
    )
    if more:
        console.print(f"[dim]more {prefix}{key} follow: --limit N shows more[/]")


def _cost(usage: dict[str, Any] | None) -> str:
    """A batch's cost so far for its row: dollars, ``unpriced`` (a model with no price), or
    ``-`` when it is not told (by an older gateway, or for a batch an older Sift made, whose
    totals are unknown).

    >>> _cost({"cost_usd": 0.0125}), _cost({"cost_usd": None}), _cost(None)
    ('$0.012500', 'unpriced', '-')
    """
    if usage is None:
        return "-"
    cost = usage.get("cost_usd")
    return "unpriced" if cost is None else f"${float(cost):.6f}"


@app.command("searches")
def searches(status: Status = None, limit: Limit = 20, json_out: JsonOut = False) -> None:
    """List your searches, newest first (within the retention: 7 days by default)."""

    def row(job: dict[str, Any]) -> list[str]:
        error = (job.get("error") or {}).get("type", "")
        return [
            plain(job["id"]), _status(job["status"]), plain(job.get("index")),
            plain(job.get("mode")), plain(job.get("query")), local_time(job.get("created_at")),
            local_time(job.get("finished_at")), plain(error),
        ]  # fmt: skip

    columns = ["id", "status", "index", "mode", "query", "created", "finished", "error"]
    drop = ["finished", "mode", "index", "created", "error"]
    _list("/v1/searches", "searches", "search", status, limit, json_out, columns, row, drop)


@app.command("batches")
def batches(status: Status = None, limit: Limit = 20, json_out: JsonOut = False) -> None:
    """List your batches, newest first (within the retention: 7 days by default), with
    their progress."""

    def row(batch: dict[str, Any]) -> list[str]:
        counts = batch.get("counts") or {}
        done = sum(int(counts.get(s, 0)) for s in ("succeeded", "failed", "canceled"))
        return [
            plain(batch["id"]), _status(batch["status"]), plain(batch.get("index")),
            plain(batch.get("lane")), f"{done}/{counts.get('total', '?')}",
            str(counts.get("failed", 0)), str(counts.get("canceled", 0)),
            _cost(batch.get("usage")),
            local_time(batch.get("created_at")), local_time(batch.get("finished_at")),
        ]  # fmt: skip

    columns = ["id", "status", "index", "lane", "done", "failed", "canceled", "cost", "created",
               "finished"]  # fmt: skip
    drop = ["finished", "lane", "index", "created", "cost", "canceled"]
    _list("/v1/batches", "batches", "batch", status, limit, json_out, columns, row, drop)


@app.command("ingestions")
def ingestions(status: Status = None, limit: Limit = 20, json_out: JsonOut = False) -> None:
    """List your ingest, delete and drop jobs, newest first (within the retention: 7 days by
    default): each one's operation, documents, and what it upserted or deleted."""

    def row(job: dict[str, Any]) -> list[str]:
        upserted, deleted = job.get("upserted"), job.get("deleted")
        return [
            plain(job["id"]), _status(job["status"]), plain(job.get("operation")),
            plain(job.get("index")), str(job.get("documents")),
            "–" if upserted is None else str(upserted), "–" if deleted is None else str(deleted),
            local_time(job.get("created_at")), local_time(job.get("finished_at")),
        ]  # fmt: skip

    # the operation and the deleted count: a drop of 20 documents read "documents 0,
    # upserted –", as an ingest not run yet does
    columns = ["id", "status", "operation", "index", "documents", "upserted", "deleted",
               "created", "finished"]  # fmt: skip
    drop = ["finished", "upserted", "deleted", "index", "created"]
    _list("/v1/ingestions", "ingestions", "ingestion", status, limit, json_out, columns, row, drop)
