"""``sift batch``: a queries file submitted as one batch, its progress shown, canceled on
Ctrl-C, and every result written."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any

import typer

from worker.cli._app import app
from worker.cli._common import (
    EXIT_INTERRUPTED,
    EXIT_ITEMS_FAILED,
    InputError,
    _err,
    _expected_errors,
    _out,
    one_of,
    why_unwritable,
)
from worker.cli._http import (
    FINAL_STATUSES,
    Gateway,
    GatewayError,
    gateway,
    index_name,
    json_of,
    json_size,
    sift_answer,
    submit_retry_seconds,
)
from worker.cli._output import failure_kinds, plain, progress_bar, usage_line
from worker.cli.client._input import (
    MODES,
    _load,
    _nothing_sent_on_interrupt,
    _report_skipped,
    query_from,
)
from worker.constants import (
    LANE_ECONOMY,
    LANE_STANDARD,
    LANES,
    MAX_BATCH_QUERIES,
    MAX_LIMIT,
)
from worker.pids import alive

#: What a run cut short says: the same command picks up its batch (:func:`batch_key`).
AGAIN = "run the same command again within 24 h to pick it up"


@contextmanager
def _cancel_on_interrupt(client: Gateway, batch_id: str) -> Iterator[None]:
    """Ctrl-C while ``sift batch`` waits cancels the batch (``DELETE /v1/batches/{id}``) and
    exits 130, saying what was canceled: the results file is this command's to write, so a
    batch left running would spend its searches and model calls for nothing."""
    try:
        yield
    except KeyboardInterrupt:
        err = _err()
        err.print(f"interrupted: canceling batch {batch_id}")
        still = f"the batch may still be running (DELETE /v1/batches/{batch_id} cancels it)"
        try:
            batch = client.json("DELETE", f"/v1/batches/{batch_id}")
        except KeyboardInterrupt:  # Ctrl-C again: the cancel may or may not have been made
            err.print(f"interrupted again: the cancel may not have been made; {still}")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except GatewayError as exc:
            if exc.status_code == 409:
                err.print(f"batch {batch_id} had already finished: nothing canceled")
            else:
                err.print(f"[bold red]error:[/] {plain(exc)}; {still}", soft_wrap=True)
        else:
            err.print(_cancel_outcome(batch_id, batch), soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _cancel_outcome(batch_id: str, batch: dict[str, Any]) -> str:
    """What a cancel's answer says, as it says it: a batch the cancel completed is final
    (``canceled``); else it is still running, and its items a worker holds are canceled
    before their model call or, past it, finish: it may yet end ``succeeded``, so it is not
    called canceled.

    >>> print(_cancel_outcome("b", {"status": "running", "counts": {"succeeded": 2}}))
    batch b: cancel made; 0 item(s) canceled so far, 2 finished; items past their model call finish
    >>> _cancel_outcome("b", {"status": "canceled", "counts": {"canceled": 3, "failed": 1}})
    'batch b canceled: 3 item(s) canceled, 1 finished'
    """
    counts = batch.get("counts") or {}
    canceled = int(counts.get("canceled", 0))
    finished = int(counts.get("succeeded", 0)) + int(counts.get("failed", 0))
    status = str(batch.get("status"))
    if status in FINAL_STATUSES:
        return f"batch {batch_id} {status}: {canceled} item(s) canceled, {finished} finished"
    return (
        f"batch {batch_id}: cancel made; {canceled} item(s) canceled so far, {finished} "
        "finished; items past their model call finish"
    )


def _batch_done(batch: dict[str, Any]) -> bool:
    if batch.get("status") in FINAL_STATUSES:
        return True
    counts = batch.get("counts") or {}
    finished = sum(int(counts.get(s, 0)) for s in FINAL_STATUSES)
    total = counts.get("total")
    return isinstance(total, int) and total > 0 and finished >= total


def _check_out(out: Path, queries: Path) -> None:
    """Refuse a results path that cannot be written (a folder, a path under a file, a place
    this user may not write) before the batch is sent: the items would run, and be paid for,
    with nowhere to put their results. So is the queries file itself (the folder's entry
    the results replace), whose queries no results line holds. Creates its missing folders."""
    if out.is_dir():
        raise InputError(f"--out: {out} is a folder, not a file; nothing was sent")
    if out.parent.resolve() / out.name == queries.parent.resolve() / queries.name:
        raise InputError(
            f"--out: {out} is the queries file: the results would replace it; nothing was sent"
        )
    why = why_unwritable(out, make_folders=True)
    if why is not None:
        raise InputError(f"--out: cannot write {out} ({why}); nothing was sent")


def batch_key(body: dict[str, Any]) -> str:
    """The ``Idempotency-Key`` of a batch's request: its body's digest, so the same file and
    options send the same key, and a run again (after a kill, a lost terminal, a poll given
    up) is answered with the batch the first run made, for the key's 24 hours, not a second
    batch searched and paid for again.

    >>> batch_key({"index": "d", "queries": [{"id": "1", "query": "q"}]})[:23]
    'sift-batch-4a6f3d019571'
    """
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sift-batch-" + hashlib.sha256(canonical.encode()).hexdigest()


def _key_after(key: str) -> str:
    """The key to send once ``key`` answered a batch canceled since, or ``410 erased``: the
    next of the file's chain of keys, the same for every run again, so the file's next batch
    is made once too. The same whether its batch was canceled or erased: a canceled batch
    erased since still leads to the batch sent after it (a key derived from the canceled
    batch's id could not be found again once it was erased). Derived as an erased batch's
    was, so a chain an earlier release made past an erased batch is still followed."""
    return "sift-batch-" + hashlib.sha256(f"{key} erased".encode()).hexdigest()


def parts_to_fit(size: int, limit: int) -> int:
    """How many parts of about equal size a request of ``size`` bytes is to be split into
    for each to fit under ``limit``: a tenth to spare, as the parts are cut at line
    boundaries and each request carries the batch's own fields too."""
    return max(2, math.ceil(size * 1.1 / limit))


def _check_body_size(client: Gateway, body: dict[str, Any], queries: Path) -> None:
    """Refuse, before sending it, a batch whose request is over the gateway's body limit:
    sent, all of it went over the wire to be answered ``413``."""
    limit = client.max_body_bytes
    if limit is None:
        return
    size = json_size(body)
    if size <= limit:
        return
    parts = parts_to_fit(size, limit)
    raise InputError(
        f"{queries}: its {len(body['queries'])} queries make a request of {size:,} bytes, more "
        f"than the gateway takes in one ({limit:,} bytes, SIFT_MAX_BODY_BYTES); nothing was "
        f"sent, no batch made: split the file into {parts} parts or more (`split -n "
        f"l/{parts} {queries} part-` cuts it at line boundaries) and run `sift batch` on each"
    )


def submit(client: Gateway, body: dict[str, Any], key: str) -> tuple[dict[str, Any], bool]:
    """Send the batch with the ``Idempotency-Key`` ``key``, again through a gateway or Redis
    restart; answers it and whether an earlier run made it (picked up). A batch of this
    body canceled since its run is not picked up: the file is sent again, as the next batch
    of the chain of keys. One whose cancel caught no item (each was past its model call)
    ends ``succeeded`` with every result, and is picked up once it has ended. A batch erased
    since (``sift erase``) is not, said on stderr: its key answers ``410 erased`` for its 24
    hours, and the run failed with that bare answer."""
    # one key for every resend: a submit whose answer was lost (the gateway restarting) is
    # answered with the batch it made, never made twice; a key left "in progress" by a
    # gateway that died before it made the batch is outwaited (submit_retry_seconds)
    window = submit_retry_seconds()
    while True:
        try:
            response = client.request(
                "POST", "/v1/batches", json=body, headers={"Idempotency-Key": key},
                retry_for=window,
            )  # fmt: skip
        except GatewayError as exc:
            if exc.status_code != HTTPStatus.GONE:  # on a POST, a replay of an erased or lost one
                raise
            _err().print(f"an earlier run's batch of this file is no longer kept ({exc.message}); "
                         "sending the file as a new batch", soft_wrap=True)  # fmt: skip
            key = _key_after(key)
            continue
        batch = sift_answer(
            json_of(response, "POST", "/v1/batches"), "POST", "/v1/batches", ("id", "status")
        )
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        if replayed and batch.get("canceled_at") and batch.get("status") not in FINAL_STATUSES:
            # its items past their model call finish: canceled only if the cancel caught one
            _err().print(f"batch {batch['id']}: an earlier run's, canceled at "
                         f"{batch['canceled_at']}; waiting for its end to see if it finished "
                         "all the same", soft_wrap=True)  # fmt: skip
            batch = client.poll(f"/v1/batches/{batch['id']}")
        if not (replayed and batch.get("status") == "canceled"):
            return batch, replayed
        key = _key_after(key)


def _sweep_partials(out: Path) -> None:
    """Remove the temp files of runs killed while writing ``out`` (their process gone): each
    is named for its run, so none is written again."""
    prefix = f".{out.name}."
    for stale in out.parent.glob(glob.escape(prefix) + "*.partial"):
        pid = stale.name[len(prefix) : -len(".partial")]
        if pid.isdigit() and not alive(int(pid)):
            stale.unlink(missing_ok=True)


def _write_results(
    client: Gateway, batch_id: str, out: Path, page_size: int
) -> tuple[Counter[str], Counter[str]]:
    """Page every result into ``out`` via a temp file renamed at the end; answers the counts
    by status, and the failed items' by error type."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_partials(out)
    temp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    tally: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    try:
        with temp.open("w", encoding="utf-8") as handle:
            path = f"/v1/batches/{batch_id}/results"
            for page in client.pages(path, {"page_size": page_size}, "results"):
                for item in page["results"]:
                    handle.write(json.dumps(item) + "\n")
                    status = str(item.get("status"))
                    tally[status] += 1
                    if status == "failed":
                        errors[str((item.get("error") or {}).get("type", "error"))] += 1
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
    return tally, errors


def _batch_cost_lines(batch: dict[str, Any]) -> list[str]:
    """A finished batch's model usage and cost, its lane's, how its items were ranked, and
    where their time went.

    >>> lines = _batch_cost_lines({"lane": "economy", "usage": {"requests": 1, "cost_usd": 0.5},
    ...     "rerank_outcomes": {"applied": 1}})
    >>> lines[0].endswith("$0.500000 (economy lane: half price)"), lines[1]
    (True, 'rerank: applied 1, fallback 0, skipped 0')
    """
    usage, outcomes = batch.get("usage"), batch.get("rerank_outcomes") or {}
    if usage is None:  # unknown: an older gateway's, or a batch an older Sift made
        return []
    lane = batch.get("lane") or LANE_STANDARD
    price = " (economy lane: half price)" if lane == LANE_ECONOMY else ""
    ranked = ", ".join(
        f"{name} {outcomes.get(name, 0)}" for name in ("applied", "fallback", "skipped")
    )
    lines = [usage_line(usage) + price, f"rerank: {ranked}"]
    stages = batch.get("stage_seconds") or {}
    if stages:
        spent = ", ".join(f"{name.replace('_', ' ')} {s:.2f}" for name, s in stages.items())
        # the items whose calls usage counts, failed reranks too (a failure before its
        # rerank, or a cancel, kept none): 'the items' read as all of them
        lines.append(f"seconds by stage (items succeeded or rerank_failed): {spent}")
    return lines


@app.command("batch")
def batch(
    queries: Annotated[Path, typer.Argument(help="queries.jsonl: BEIR (_id,text) or Sift's")],
    index: Annotated[str, typer.Option("--index", callback=index_name, help="the index to search")],
    out: Annotated[Path, typer.Option("--out", help="where to write RESULTS.jsonl")],
    limit: Annotated[
        int | None, typer.Option(min=1, max=MAX_LIMIT, help="hits per query, if a line has none")
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(callback=one_of(MODES), help="fts, vector or hybrid, if a line has none"),
    ] = None,
    rerank: Annotated[
        bool | None,
        typer.Option("--rerank/--no-rerank", help="override the server's default"),
    ] = None,
    lane: Annotated[
        str, typer.Option(callback=one_of(LANES), help="standard or economy")
    ] = LANE_STANDARD,
    webhook_url: Annotated[
        str | None, typer.Option("--webhook-url", help="POST batch.completed here")
    ] = None,
    skip_invalid: Annotated[
        bool, typer.Option("--skip-invalid", help="skip bad lines instead of stopping")
    ] = False,
    page_size: Annotated[int, typer.Option(min=1, max=1000, help="results per page")] = 500,
    strict: Annotated[
        bool, typer.Option("--strict", help=f"exit {EXIT_ITEMS_FAILED} if any item failed")
    ] = False,
    new: Annotated[
        bool,
        typer.Option("--new", help="send the file as a new batch, not pick up an earlier run's"),
    ] = False,
) -> None:
    """Submit a batch of searches, show progress while it runs, and write every result.

    Run again with the same file and options within 24 hours, it picks up the batch its
    earlier run sent (killed, interrupted while submitting or writing, its polls given up)
    instead of sending it again; a batch canceled since (Ctrl-C while it waits cancels it)
    or erased since (`sift erase`) is sent as a new one."""
    console = _out()
    with _expected_errors():
        with _nothing_sent_on_interrupt(queries, "nothing was sent, no batch made"):
            loaded = _load(queries, query_from, skip_invalid=skip_invalid, unique_ids=True)
            _report_skipped(console, loaded.problems)
            items = loaded.records
            if not items:
                raise InputError(f"{queries}: no queries to send")
            if len(items) > MAX_BATCH_QUERIES:
                raise InputError(
                    f"{queries}: {len(items)} queries; a batch holds {MAX_BATCH_QUERIES}"
                )
            _check_out(out, queries)
        for item in items:
            if limit is not None:
                item.setdefault("limit", limit)
            if mode is not None:
                item.setdefault("mode", mode)
        body: dict[str, Any] = {"index": index, "queries": items, "lane": lane}
        if rerank is not None:
            body["rerank"] = rerank
        if webhook_url:
            body["webhook_url"] = webhook_url
        started = time.monotonic()
        with gateway() as client:
            _check_body_size(client, body, queries)
            try:
                key = f"sift-batch-{uuid.uuid4().hex}" if new else batch_key(body)
                submitted, picked_up = submit(client, body, key)
            except GatewayError as exc:
                if exc.status_code != HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
                    raise
                raise GatewayError(
                    f"{exc.message}: the {len(items)} queries of {queries} are more than the "
                    "gateway takes in one request (SIFT_MAX_BODY_BYTES on the gateway, 32 MiB "
                    "by default); no batch was made: split the file and run `sift batch` on "
                    "each part",
                    status_code=exc.status_code,
                ) from exc
            except KeyboardInterrupt:  # no id to cancel: the batch may run all the same
                _err().print(
                    "interrupted while submitting: the batch may have been accepted and run on; "
                    + ("" if new else f"{AGAIN} ")
                    + "(`sift batches --limit 1` shows it, DELETE /v1/batches/{id} cancels it)",
                    soft_wrap=True,
                )
                raise typer.Exit(EXIT_INTERRUPTED) from None
            batch_id = str(submitted["id"])
            # how to have its results once this run is cut short: the same command, or with
            # --new (a key of its own, which no run again sends) the batch's results route
            again = (
                f"GET /v1/batches/{batch_id}/results pages its results once it has finished"
                if new
                else f"{AGAIN} and write its results"
            )
            if picked_up:
                console.print(
                    f"batch [bold]{batch_id}[/]: picked up, {len(items)} queries an earlier run "
                    f"sent at {submitted.get('created_at')} ({submitted.get('status')}); "
                    "--new sends them as another batch",
                    soft_wrap=True,
                )
            else:
                console.print(f"batch [bold]{batch_id}[/]: {len(items)} queries submitted")
            with _cancel_on_interrupt(client, batch_id), progress_bar() as progress:
                task = progress.add_task(f"batch {index}", total=len(items))

                def show(state: dict[str, Any]) -> None:
                    counts = state.get("counts") or {}
                    finished = sum(int(counts.get(s, 0)) for s in FINAL_STATUSES)
                    total = counts.get("total") or len(items)
                    progress.update(task, completed=finished, total=total)

                try:
                    final = client.poll(f"/v1/batches/{batch_id}", done=_batch_done, on_update=show)
                except GatewayError as exc:  # given up: the batch runs on without us
                    if not exc.transient:
                        raise
                    raise GatewayError(
                        f"{exc.message}; batch {batch_id} may still be running, with no "
                        f"results file written: {again} "
                        f"(DELETE /v1/batches/{batch_id} cancels it)"
                    ) from exc
            try:
                tally, errors = _write_results(client, batch_id, out, page_size)
            except KeyboardInterrupt:  # the batch is final: nothing to cancel, all to read
                _err().print(
                    f"interrupted while writing the results: batch {batch_id} has finished; "
                    f"nothing was written to {plain(out)}; {again}",
                    soft_wrap=True,
                )
                raise typer.Exit(EXIT_INTERRUPTED) from None
            except OSError as exc:  # writable when checked, not now (a full disk...)
                raise InputError(
                    f"--out: cannot write {out} ({exc.strerror or exc}); batch {batch_id} has "
                    f"finished: {again}"
                    + (
                        ""
                        if new
                        else " (--out may name another file: the key is the queries' "
                        "and options', not the file's)"
                    )
                ) from exc
        written = sum(tally.values())
        counts = final.get("counts") or {}
        total = int(counts.get("total") or len(items))
        elapsed = time.monotonic() - started
        parts = [f"{name} {tally.get(name, 0)}" for name in ("succeeded", "failed", "canceled")]
        # the summary's lines whole, as a script reads them: rich breaks them at 80 columns
        # when the output is not a terminal (a terminal wraps them itself)
        console.print(
            f"wrote {written} result(s) to [bold]{plain(out)}[/] in {elapsed:.1f} s: "
            + ", ".join(parts),
            soft_wrap=True,
        )
        for line in _batch_cost_lines(final):
            console.print(line, soft_wrap=True)
        if written != total:
            raise GatewayError(f"batch {batch_id}: {total} queries but {written} results returned")
        not_ok = tally.get("failed", 0) + tally.get("canceled", 0)
        if not_ok:
            # the error types at once: a mistyped --index fails every item, index_not_found
            why = failure_kinds(final.get("failures"), final.get("rerank_failures"), errors)
            _err().print(
                f"[bold red]{tally.get('failed', 0)} failed"
                + (f" ({why})" if why else "")
                + f", {tally.get('canceled', 0)} canceled[/] of {total}; see the error of each "
                f"in {plain(out)}",
                soft_wrap=True,
            )
            if strict:
                raise typer.Exit(EXIT_ITEMS_FAILED)
