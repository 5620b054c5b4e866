"""``sift eval --index``'s runs: each one a batch through the gateway, all submitted at once,
waited on with a progress bar and read back page by page (Ctrl-C cancels every one)."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from worker.cli._common import EXIT_INTERRUPTED
from worker.cli._http import (
    FINAL_STATUSES,
    RETRY_SECONDS,
    Gateway,
    GatewayError,
    gateway,
    segment,
    submit_retry_seconds,
)
from worker.cli._output import cli_console, plain, progress_bar
from worker.cli.client._batch import _cancel_outcome, submit
from worker.constants import MAX_WAIT_SECONDS
from worker.evaluation.inputs import judged_queries
from worker.evaluation.scoring import DEFAULT_WINDOW, RunSpec, probe_spec, window_of

console = Console(emoji=False)
PAGE_SIZE = 500


def _judged(
    queries: Path, qrels_path: Path, qrels: dict[str, dict[str, int]], max_queries: int | None
) -> list[tuple[str, str]]:
    """The judged queries; ValueError when there is none (every measure would be undefined)."""
    judged = judged_queries(queries, qrels, max_queries)
    if not judged:
        raise ValueError(f"{queries}: no query has a relevant document in {qrels_path}")
    return judged


def _check_index(index: str) -> dict[str, Any]:
    """The index's metadata, or the gateway's 404 (``index 'NAME' does not exist``, exit 1,
    as every other index command says it) when the caller has no such index, before any
    search: the runs all failed ``index_not_found`` and scored a table of 0.000, exit 3, the
    typo's table printed as if measured."""
    with gateway() as client:
        found: dict[str, Any] = client.json(
            "GET", f"/v1/indexes/{segment(index)}", retry_for=RETRY_SECONDS
        )
    return found


def _index_written(index: str, before: dict[str, Any]) -> str | None:
    """What was written to the index since ``before`` (its metadata as :func:`_check_index`
    read it), read again once the runs are done; None if nothing was. Its last write moves
    with every write that changed one of its documents, and only then (docs/indexes.md), so
    runs read between two equal readings read one state of it. Without this check, the
    runs of an index written meanwhile were scored as one: with half its documents deleted
    while they ran, the fused run (read after) scored 0.019 against BM25's 0.054 (read
    before), and the command advised tuning the fusion, exit 0."""
    try:
        after = _check_index(index)
    except GatewayError as error:
        if error.status_code != 404:
            raise
        return f"it was dropped (it held {before.get('documents')} documents)"
    fields = ("documents", "last_write_at")
    if all(after.get(field) == before.get(field) for field in fields):
        return None
    return (
        f"documents {before.get('documents')} → {after.get('documents')}, "
        f"last write {before.get('last_write_at')} → {after.get('last_write_at')}"
    )


def _served_window(index: str, query: str) -> int:
    """The rerank candidate window the index's searches use (the index's own, else the
    deployment's ``SIFT_RERANK_CANDIDATE_LIMIT``), as the trace of one search of ``query``
    (one hit, no model) says; the default's 30 if the search fails (an index dropped since
    :func:`_check_index`: its runs fail too, and say why). Sent again with its key for
    :func:`submit_retry_seconds`, as every keyed submission is, so that it outwaits a key
    claim left in progress by a gateway that died before it made the job."""
    body = probe_spec(index, query).model_dump(mode="json")
    with gateway() as client:
        key = {"Idempotency-Key": f"sift-eval-window-{uuid.uuid4().hex}"}
        job = client.json(
            "POST", "/v1/searches", json=body, params={"wait": int(MAX_WAIT_SECONDS)},
            headers=key, retry_for=submit_retry_seconds(), fields=("id", "status"),
        )  # fmt: skip
        if job.get("status") not in FINAL_STATUSES:
            job = client.poll(f"/v1/searches/{job['id']}")
    return window_of((job.get("result") or {}).get("trace")) or DEFAULT_WINDOW


def _run_batches(
    index: str, runs: list[RunSpec], queries: list[tuple[str, str]], out: Path | None
) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """Each run as one batch through the gateway, all submitted at once: the batch ids and
    every result of each, in the order of ``runs`` (kept under ``out`` when given). A run
    that reranks is submitted first: a deployment with no generation model refuses it (422)
    before any other batch has started its searches."""
    with gateway() as client, _cancel_runs_on_interrupt(client, len(runs)) as submitted:
        for run in sorted(runs, key=lambda run: not run.rerank):  # stable: the rest in order
            submitted[run.name] = _submit(client, index, run, queries)
        with progress_bar() as bar:
            tasks = {
                run.name: bar.add_task(f"{run.name} via {index}", total=len(queries))
                for run in runs
            }
            pending = dict(submitted)
            while pending:
                for name, batch_id in list(pending.items()):
                    # a GET: read again through a transient failure, as `sift batch` waits
                    path = f"/v1/batches/{batch_id}"
                    counts = client.json("GET", path, retry_for=RETRY_SECONDS).get("counts") or {}
                    finished = sum(int(counts.get(s, 0)) for s in FINAL_STATUSES)
                    bar.update(tasks[name], completed=finished)
                    if finished >= len(queries):
                        del pending[name]
                if pending:
                    time.sleep(0.5)
        served = {}
        for run in runs:
            served[run.name] = list(_results(client, submitted[run.name]))
            if out is not None:
                _write_jsonl(out / f"{run.name.split()[0]}.jsonl", served[run.name])
    return {run.name: submitted[run.name] for run in runs}, served


@contextmanager
def _cancel_runs_on_interrupt(client: Gateway, runs: int) -> Iterator[dict[str, str]]:
    """Yields the runs' batch ids as they are made; Ctrl-C meanwhile cancels every one, says
    what each cancel did and exits 130, as ``sift batch`` does (Ctrl-C again leaves at once,
    naming the batches whose cancel may not have been made): the scores are this command's
    to make, so batches left running would spend their searches (and a reranked run its
    model calls) for nothing. A gateway error that stops the command (a submit or a poll
    given up) cancels them too, and is raised after."""
    submitted: dict[str, str] = {}
    try:
        yield submitted
    except GatewayError:
        err = cli_console(stderr=True)
        for name, batch_id in submitted.items():
            said = _cancel_run(client, batch_id)
            err.print(f"stopped: the {name} run's {said}", soft_wrap=True, markup=False)
        raise
    except KeyboardInterrupt:
        err = cli_console(stderr=True)
        for done, (name, batch_id) in enumerate(submitted.items()):
            try:
                said = _cancel_run(client, batch_id)
            except KeyboardInterrupt:  # Ctrl-C again: leave now, naming what may run on
                left = ", ".join(list(submitted.values())[done:])
                err.print(
                    f"interrupted again: the cancels of {left} may not have been made; they "
                    "may still be running (DELETE /v1/batches/{id} cancels each)",
                    soft_wrap=True,
                    markup=False,
                )
                raise typer.Exit(EXIT_INTERRUPTED) from None
            err.print(f"interrupted: the {name} run's {said}", soft_wrap=True, markup=False)
        if len(submitted) < runs:
            err.print(
                "interrupted while submitting: a run's batch may have been accepted and run on; "
                "`sift batches --limit 1` shows it",
                soft_wrap=True,
            )
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _cancel_run(client: Gateway, batch_id: str) -> str:
    """Cancel a run's batch (``DELETE /v1/batches/{id}``); answers what the cancel did, or
    why it did nothing."""
    try:
        return _cancel_outcome(batch_id, client.json("DELETE", f"/v1/batches/{batch_id}"))
    except GatewayError as exc:
        if exc.status_code == 409:
            return f"batch {batch_id} had already finished: nothing canceled"
        return (
            f"{plain(exc)}; batch {batch_id} may still be running "
            f"(DELETE /v1/batches/{batch_id} cancels it)"
        )


def _submit(client: Gateway, index: str, run: RunSpec, queries: list[tuple[str, str]]) -> str:
    """Send the run's batch as ``sift batch`` does, sent again with its key through a gateway
    or Redis restart; its key is this command's own (an evaluation reads the index as it is
    now: a run again sends new batches, never picks up an earlier run's)."""
    items = [
        {"id": qid, "query": text, "mode": run.mode, "limit": run.limit} for qid, text in queries
    ]
    body: dict[str, Any] = {"index": index, "queries": items, "rerank": run.rerank}
    if run.candidate_limit is not None:
        body["candidate_limit"] = run.candidate_limit
    batch, _ = submit(client, body, f"sift-eval-{uuid.uuid4().hex}")
    return str(batch["id"])


def _results(client: Gateway, batch_id: str) -> Iterator[dict[str, Any]]:
    """Every result of a batch, page by page, in submission order."""
    path = f"/v1/batches/{batch_id}/results"
    for page in client.pages(path, {"page_size": PAGE_SIZE}, "results"):
        yield from page["results"]


def _write_jsonl(path: Path, items: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    temp.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    os.replace(temp, path)
