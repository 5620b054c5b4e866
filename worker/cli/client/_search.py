"""``sift search``: one search through the gateway, its ranked hits printed."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

import typer
from rich.console import Console

from worker.cli._app import app
from worker.cli._common import EXIT_INTERRUPTED, _err, _expected_errors, _out, one_of
from worker.cli._http import (
    FINAL_STATUSES,
    GatewayError,
    gateway,
    index_name,
    json_of,
    sift_answer,
    submit_retry_seconds,
    utf8_text,
)
from worker.cli._output import plain, print_result, trace_lines, usage_line
from worker.cli.client._input import MODES
from worker.constants import MAX_LIMIT, MAX_WAIT_SECONDS


def _print_search(console: Console, job: dict[str, Any], *, trace: bool) -> None:
    result = job.get("result") or {}
    print_result(console, result)
    if trace:
        _print_trace(console, result.get("trace"))


def _print_trace(console: Console, trace: object) -> None:
    """A search's trace, compactly: a result's, or the one a failed search keeps on its
    error (``error.trace``: up to the failure, which it names)."""
    if isinstance(trace, dict):
        console.print("[bold]trace[/] (the raw trace: --json)")
        for line in trace_lines(trace):
            console.print(f"  {plain(line)}", soft_wrap=True)


def _search_interrupted(job: dict[str, Any] | None) -> str:
    """What Ctrl-C left of a ``sift search``: a search runs on once accepted (it has no cancel).

    >>> _search_interrupted({"id": "srch_1", "status": "running"})
    'interrupted: search srch_1 runs on; GET /v1/searches/srch_1 has its result once done'
    """
    if job is None:
        return (
            "interrupted while submitting: the search may have been accepted and run on; "
            "`sift searches --limit 1` shows it"
        )
    return (
        f"interrupted: search {job['id']} runs on; GET /v1/searches/{job['id']} has its "
        "result once done"
    )


def _billed_usage(job: dict[str, Any]) -> dict[str, Any] | None:
    """What a search that did not succeed was billed (its error's ``usage``: the attempts the
    provider billed before it failed), or None when it made no model call.

    >>> _billed_usage({"status": "failed", "error": {"type": "x", "usage": {"requests": 3}}})
    {'requests': 3}
    >>> _billed_usage({"status": "failed", "error": {"type": "x", "usage": None}}) is None
    True
    """
    error = job.get("error")
    usage = error.get("usage") if isinstance(error, dict) else None
    return usage if isinstance(usage, dict) and usage.get("requests") else None


def _job_failure(job: dict[str, Any]) -> str:
    error = job.get("error") or {}
    if isinstance(error, dict):
        return f"{error.get('type', 'error')}: {error.get('message', '')}"
    return str(error)


@app.command("search")
def search(
    query: Annotated[str, typer.Argument(callback=utf8_text, help="the query text")],
    index: Annotated[str, typer.Option("--index", callback=index_name, help="the index to search")],
    limit: Annotated[int, typer.Option(min=1, max=MAX_LIMIT, help="hits to return")] = 10,
    mode: Annotated[
        str, typer.Option(callback=one_of(MODES), help="fts, vector or hybrid")
    ] = "hybrid",
    rerank: Annotated[
        bool | None,
        typer.Option("--rerank/--no-rerank", help="override the server's default"),
    ] = None,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace",
            help="ask for the trace and print it compactly (with --json: the raw trace)",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the raw job as JSON")] = False,
) -> None:
    """Run one search through the gateway and print the ranked hits."""
    console = _out()
    with _expected_errors():
        body: dict[str, Any] = {
            "index": index,
            "query": query,
            "limit": limit,
            "mode": mode,
            "include_trace": trace,
        }
        if rerank is not None:
            body["rerank"] = rerank
        with gateway() as client:
            wait = int(MAX_WAIT_SECONDS)
            submitted: dict[str, Any] | None = None
            try:
                # one key for every resend (a 503 while Redis is down or restarting, a
                # gateway restart): a submit whose answer was lost is answered with the
                # search it made, never run and paid for twice (as `sift batch` sends)
                key = {"Idempotency-Key": f"sift-search-{uuid.uuid4().hex}"}
                response = client.request(
                    "POST", "/v1/searches", json=body, params={"wait": wait}, headers=key,
                    retry_for=submit_retry_seconds(),
                )  # fmt: skip
                answer = json_of(response, "POST", "/v1/searches")
                job = submitted = sift_answer(answer, "POST", "/v1/searches", ("id", "status"))
                if job.get("status") not in FINAL_STATUSES:
                    job = client.poll(f"/v1/searches/{job['id']}")
            except KeyboardInterrupt:  # a search has no cancel: say that it runs on
                _err().print(_search_interrupted(submitted), soft_wrap=True)
                raise typer.Exit(EXIT_INTERRUPTED) from None
        if json_out:
            typer.echo(json.dumps(job))
        elif job.get("status") == "succeeded":
            _print_search(console, job, trace=trace)
        elif trace and isinstance(job.get("error"), dict):
            _print_trace(console, job["error"].get("trace"))
        if job.get("status") != "succeeded":
            billed = _billed_usage(job)
            if billed is not None:  # paid whether the search failed or not
                _err().print(usage_line(billed), soft_wrap=True)
            raise GatewayError(f"search {job.get('id')} {job.get('status')}: {_job_failure(job)}")
