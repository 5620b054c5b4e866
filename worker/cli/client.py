"""``sift ingest``, ``sift search`` and ``sift batch``: the gateway's HTTP API from the shell.

Each command reads ``SIFT_URL`` (default ``http://127.0.0.1:8080``) and
``SIFT_API_KEY``. Expected failures (a bad input line, a 4xx naming a field,
no gateway listening) print one clear message and exit 1, without a traceback.
``sift batch`` exits 0 when every item is accounted for, even if some items
failed (it prints the failed count in red); ``--strict`` makes that exit 3.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console

from worker.cli import app
from worker.cli._http import (
    FINAL_STATUSES,
    RETRY_SECONDS,
    Gateway,
    GatewayError,
    gateway,
    index_name,
    segment,
)
from worker.cli._output import (
    cli_console,
    plain,
    print_result,
    progress_bar,
    trace_lines,
    usage_line,
)
from worker.constants import (
    IDEMPOTENCY_PENDING_TTL_SECONDS,
    MAX_BATCH_QUERIES,
    MAX_DOCUMENT_CHARS,
    MAX_DOCUMENTS_PER_REQUEST,
    MAX_LIMIT,
    MAX_QUERY_CHARS,
    MAX_WAIT_SECONDS,
)
from worker.contract import DocumentRequest

MODES = ("fts", "vector", "hybrid")
LANES = ("standard", "economy")
EXIT_ERROR = 1
EXIT_ITEMS_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class InputError(Exception):
    """A bad line in an input file; the message names the file, the line and the field."""


@dataclass
class Loaded:
    """The valid records of a JSONL file, the line number of each, and the problems of the
    invalid ones."""

    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _out() -> Console:
    return cli_console()


def _err() -> Console:
    return cli_console(stderr=True)


@contextmanager
def _expected_errors() -> Iterator[None]:
    """Turn expected failures into one red line on stderr and exit code 1."""
    try:
        yield
    except (GatewayError, InputError) as exc:
        _err().print(f"[bold red]error:[/] {plain(exc)}", soft_wrap=True)
        raise typer.Exit(EXIT_ERROR) from None


def _jsonl(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` per non-blank line; each is parsed by :func:`_parsed`, where a
    line that is not UTF-8 or not JSON is a bad line like any other (``--skip-invalid`` skips
    it: a file cut off mid-line may be cut inside a character). Bytes that are not UTF-8 are
    kept as lone surrogates (``surrogateescape``), which no decoded text holds."""
    try:
        handle = path.open(encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def _parsed(line: str) -> Any:
    """One line's JSON; raises ValueError saying it is not UTF-8 or not JSON."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a byte surrogateescape kept: the line is not UTF-8
        raise ValueError("not UTF-8 text") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None


def _pydantic_problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "document"
    return f"field {where!r}: {first['msg']}"


def document_from(obj: Any) -> dict[str, Any]:
    """A BEIR ``corpus.jsonl`` line (``_id``) or a Sift document as the gateway's document.

    Raises ValueError naming the field.
    """
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    if "_id" in obj:  # BEIR: _id, title, text (its optional metadata is not Sift's)
        obj = {"id": obj["_id"], "title": obj.get("title") or "", "text": obj.get("text")}
    try:  # the gateway's own checks (metadata every backend can hold), so nothing is sent
        document = DocumentRequest.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(_pydantic_problem(exc)) from None
    if len(document.text) > MAX_DOCUMENT_CHARS:
        raise ValueError(f"field 'text': longer than {MAX_DOCUMENT_CHARS} characters")
    return document.model_dump(exclude_none=True)


def query_from(obj: Any) -> dict[str, Any]:
    """A BEIR ``queries.jsonl`` line (``_id``, ``text``) or a Sift query as a batch item.

    Raises ValueError naming the field.
    """
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    if "_id" in obj:  # BEIR: _id, text (metadata ignored)
        obj = {"id": obj["_id"], "query": obj.get("text")}
    unknown = sorted(set(obj) - {"id", "query", "limit", "mode"})
    if unknown:
        raise ValueError(f"field {unknown[0]!r}: not a query field (id, query, limit, mode)")
    query_id, text = obj.get("id"), obj.get("query")
    if not isinstance(query_id, str) or not query_id:
        raise ValueError("field 'id': a non-empty string is required")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("field 'query': a non-empty string is required")
    if len(text) > MAX_QUERY_CHARS:
        raise ValueError(f"field 'query': longer than {MAX_QUERY_CHARS} characters")
    item: dict[str, Any] = {"id": query_id, "query": text}
    if "limit" in obj:
        limit = obj["limit"]
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"field 'limit': an integer from 1 to {MAX_LIMIT} is required")
        item["limit"] = limit
    if "mode" in obj:
        if obj["mode"] not in MODES:
            raise ValueError(f"field 'mode': one of {', '.join(MODES)} is required")
        item["mode"] = obj["mode"]
    return item


def _load(path: Path, parse: Any, *, skip_invalid: bool, unique_ids: bool = False) -> Loaded:
    """Read and check every line first, so a bad line stops the command before anything is sent."""
    loaded = Loaded()
    seen: set[str] = set()
    for number, line in _jsonl(path):
        try:
            record = parse(_parsed(line))
            if unique_ids:
                if record["id"] in seen:
                    raise ValueError(f"field 'id': {record['id']!r} appears twice")
                seen.add(record["id"])
        except ValueError as exc:
            problem = f"{path}:{number}: {exc}"
            if not skip_invalid:
                raise InputError(
                    problem + " (nothing was sent; --skip-invalid skips such lines)"
                ) from None
            loaded.problems.append(problem)
            continue
        loaded.records.append(record)
        loaded.lines.append(number)
    return loaded


def _report_skipped(console: Console, problems: list[str]) -> None:
    if not problems:
        return
    _err().print(f"[yellow]skipped {len(problems)} invalid line(s):[/]")
    for problem in problems[:10]:
        _err().print(f"  {plain(problem)}", soft_wrap=True)
    if len(problems) > 10:
        _err().print(f"  … and {len(problems) - 10} more")


def _send_documents(
    client: Gateway,
    index: str,
    documents: list[dict[str, Any]],
    on_indexed: Callable[[int], object] = lambda n: None,
    stopping: threading.Event | None = None,
    on_unsettled: Callable[[str], object] = lambda job_id: None,
) -> int:
    """POST one batch and wait for its ingest job; answers how many documents it upserted.

    The gateway answers 200 with the finished job when it finished within ``wait``, else
    202 with a job to poll at ``GET /v1/ingestions/{id}``. A batch over the gateway's body
    limit (413: 500 documents of up to 100,000 characters each pass its 32 MiB) is sent
    again in halves, in order; a document alone over it is named. ``on_indexed`` is called
    with the number of documents of each request whose job succeeded, so the documents
    known indexed are always the first ones of ``documents``. Once ``stopping`` is set (a
    Ctrl-C), no request is sent and a job's poll stops: its documents are not known indexed,
    and ``on_unsettled`` is called with the id of the job, which may still index them.
    """
    stopping = stopping or threading.Event()  # none given: never set
    if stopping.is_set():
        return 0
    path = f"/v1/indexes/{segment(index)}/documents"
    try:
        response = client.request("POST", path, params={"wait": 30}, json={"documents": documents})
    except GatewayError as exc:
        if exc.status_code != HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
            raise
        if len(documents) == 1:
            raise GatewayError(
                f"document {documents[0]['id']!r} alone is larger than the gateway takes in "
                f"one request ({exc.message}; SIFT_MAX_BODY_BYTES on the gateway)",
                status_code=exc.status_code,
            ) from exc
        half = len(documents) // 2
        return sum(
            _send_documents(client, index, part, on_indexed, stopping, on_unsettled)
            for part in (documents[:half], documents[half:])
        )
    job = response.json()
    if job.get("status") not in FINAL_STATUSES:
        job = client.poll(
            f"/v1/ingestions/{job['id']}",
            done=lambda body: body.get("status") in FINAL_STATUSES or stopping.is_set(),
        )
        if job.get("status") not in FINAL_STATUSES:  # interrupted: its outcome is unknown
            on_unsettled(str(job.get("id")))
            return 0
    if job.get("status") != "succeeded":
        error = job.get("error") or {}
        message = error.get("message") if isinstance(error, dict) else error
        raise GatewayError(f"ingest job {job.get('id')} {job.get('status')}: {message}")
    on_indexed(len(documents))
    return int(job.get("upserted") or 0)


def _chunks(documents: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    """The requests' documents, ``size`` at most each, in file order. No request holds an id
    twice (the gateway refuses it: one write per id and request): a repeated id starts the
    next request, so its last line is written last and wins."""
    chunks: list[list[dict[str, Any]]] = []
    ids: set[str] = set()
    for document in documents:
        if not chunks or len(chunks[-1]) == size or document["id"] in ids:
            chunks.append([])
            ids = set()
        chunks[-1].append(document)
        ids.add(document["id"])
    return chunks


def _resume_note(
    file: Path,
    loaded: Loaded,
    chunks: list[list[dict[str, Any]]],
    done: list[int],
    unsettled: list[str],
) -> str:
    """What a failed ``sift ingest`` is known to have indexed, and the line to go on from.
    ``done`` holds how many of each request's first documents are known indexed (a
    request's halves go in order): every line before the first one not known indexed was,
    and a later request (two are in flight) may have been too. ``unsettled``: the jobs whose
    polls were stopped before they were done, which may still index their documents."""
    note = _known_indexed(file, loaded, chunks, done)
    if unsettled:
        note += f"; job(s) {', '.join(unsettled)} were not done yet and may still index theirs"
    return note


def _known_indexed(
    file: Path, loaded: Loaded, chunks: list[list[dict[str, Any]]], done: list[int]
) -> str:
    first = 0  # in file order, the first document not known indexed
    for chunk, indexed in zip(chunks, done, strict=True):
        first += indexed
        if indexed < len(chunk):
            break
    known, total = sum(done), len(loaded.records)
    if first >= total:
        return f"all {total} document(s) of {file} were indexed"
    if not known:
        return f"none of the {total} document(s) of {file} is known indexed"
    line = loaded.lines[first]
    before = f", all those before line {line}" if first else ""
    return (
        f"{known} of {total} document(s) of {file} known indexed{before}; resume from line "
        f"{line} (document {loaded.records[first]['id']!r}), or send the whole file again: "
        "an ingest replaces each document by id, so those indexed are written again, not "
        "duplicated"
    )


def _leave(code: int) -> NoReturn:
    """Exit now, without joining the threads still waiting on the gateway's answers (as
    ``concurrent.futures`` does at exit, up to a request's 30 s ``?wait=``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextmanager
def _pool(threads: int) -> Iterator[ThreadPoolExecutor]:
    """Threads for requests; on an error, the ones not yet sent are dropped, not sent."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="sift-ingest")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@app.command("ingest")
def ingest(
    file: Annotated[Path, typer.Argument(help="corpus.jsonl: BEIR (_id,title,text) or Sift's")],
    index: Annotated[
        str, typer.Option("--index", callback=index_name, help="the index to load into")
    ],
    batch_size: Annotated[
        int,
        typer.Option(min=1, max=MAX_DOCUMENTS_PER_REQUEST, help="documents per request"),
    ] = 500,
    skip_invalid: Annotated[
        bool, typer.Option("--skip-invalid", help="skip bad lines instead of stopping")
    ] = False,
) -> None:
    """Load documents through the gateway, with a progress bar."""
    console = _out()
    with _expected_errors():
        loaded = _load(file, document_from, skip_invalid=skip_invalid)
        _report_skipped(console, loaded.problems)
        documents = loaded.records
        if not documents:
            raise InputError(f"{file}: no documents to send")
        started = time.monotonic()
        indexed = 0
        chunks = _chunks(documents, batch_size)
        done = [0] * len(chunks)  # how many of each request's first documents are indexed

        stopping = threading.Event()  # Ctrl-C or a failure: no more requests, no more polls
        unsettled: list[str] = []  # the jobs whose polls it stopped, not yet final

        def send(i: int) -> int:
            def on_indexed(n: int) -> None:
                done[i] += n

            return _send_documents(client, index, chunks[i], on_indexed, stopping, unsettled.append)

        # Two requests in flight keep the worker busy while a finished job is answered and
        # the next one sent; only when no id repeats, so a repeated id's last line still wins.
        in_flight = 2 if len({d["id"] for d in documents}) == len(documents) else 1
        with gateway() as client:
            try:
                with progress_bar(console) as progress, _pool(in_flight) as pool:
                    task = progress.add_task(f"ingest {index}", total=len(documents))
                    try:
                        sent = [pool.submit(send, i) for i in range(len(chunks))]
                        for chunk, reply in zip(chunks, sent, strict=True):
                            indexed += reply.result()
                            progress.advance(task, len(chunk))
                    except KeyboardInterrupt:
                        stopping.set()
                        _err().print(
                            "interrupted: waiting for the answers to the requests already "
                            "sent (Ctrl-C again to leave without them)"
                        )
                    except GatewayError:
                        # the requests in flight are answered, but not polled on: a job that
                        # did not run held the failure back for good
                        stopping.set()
                        raise
            except GatewayError as exc:  # the pool has waited for the requests in flight
                note = _resume_note(file, loaded, chunks, done, unsettled)
                raise GatewayError(f"{exc.message}; {note}", status_code=exc.status_code) from exc
            except KeyboardInterrupt as exc:  # while the requests in flight were awaited
                note = plain(_resume_note(file, loaded, chunks, done, unsettled))
                failed = exc.__context__  # the failure whose requests in flight were awaited
                why = (
                    f"[bold red]error:[/] {plain(failed.message)}; then interrupted"
                    if isinstance(failed, GatewayError)
                    else "interrupted again"
                )
                _err().print(
                    f"{why}: {note}; the requests sent before it may still be indexed",
                    soft_wrap=True,
                )
                _leave(EXIT_INTERRUPTED)  # the pool's threads, waiting on answers, hold an exit
            if stopping.is_set():
                note = plain(_resume_note(file, loaded, chunks, done, unsettled))
                _err().print(f"interrupted: {note}", soft_wrap=True)
                raise typer.Exit(EXIT_INTERRUPTED)
        elapsed = time.monotonic() - started
        console.print(
            f"indexed [bold]{indexed}[/] document(s) into [bold]{index}[/] in {elapsed:.1f} s"
            + (f"; skipped {len(loaded.problems)} invalid line(s)" if loaded.problems else "")
        )


def _print_search(console: Console, job: dict[str, Any], *, trace: bool) -> None:
    result = job.get("result") or {}
    print_result(console, result)
    if trace and result.get("trace") is not None:
        console.print("[bold]trace[/] (the raw trace: --json)")
        for line in trace_lines(result["trace"]):
            console.print(f"  {plain(line)}", soft_wrap=True)


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


def _job_failure(job: dict[str, Any]) -> str:
    error = job.get("error") or {}
    if isinstance(error, dict):
        return f"{error.get('type', 'error')}: {error.get('message', '')}"
    return str(error)


@app.command("search")
def search(
    query: Annotated[str, typer.Argument(help="the query text")],
    index: Annotated[str, typer.Option("--index", callback=index_name, help="the index to search")],
    limit: Annotated[int, typer.Option(min=1, max=MAX_LIMIT, help="hits to return")] = 10,
    mode: Annotated[str, typer.Option(help="fts, vector or hybrid")] = "hybrid",
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
        if mode not in MODES:
            raise InputError(f"--mode: one of {', '.join(MODES)} is required, not {mode!r}")
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
            response = client.request("POST", "/v1/searches", json=body, params={"wait": wait})
            job = response.json()
            if job.get("status") not in FINAL_STATUSES:
                job = client.poll(f"/v1/searches/{job['id']}")
        if json_out:
            typer.echo(json.dumps(job))
        elif job.get("status") == "succeeded":
            _print_search(console, job, trace=trace)
        if job.get("status") != "succeeded":
            raise GatewayError(f"search {job.get('id')} {job.get('status')}: {_job_failure(job)}")


def _batch_done(batch: dict[str, Any]) -> bool:
    if batch.get("status") in FINAL_STATUSES:
        return True
    counts = batch.get("counts") or {}
    finished = sum(int(counts.get(s, 0)) for s in FINAL_STATUSES)
    total = counts.get("total")
    return isinstance(total, int) and total > 0 and finished >= total


def _check_out(out: Path) -> None:
    """Refuse a results path that cannot be written (a folder, a path under a file, a place
    this user may not write) before the batch is sent: the items would run, and be paid for,
    with nowhere to put their results. Creates its missing folders."""
    if out.is_dir():
        raise InputError(f"--out: {out} is a folder, not a file; nothing was sent")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise InputError(
            f"--out: cannot write {out} ({exc.strerror or exc}); nothing was sent"
        ) from exc


def _write_results(client: Gateway, batch_id: str, out: Path, page_size: int) -> dict[str, int]:
    """Page every result into ``out`` via a temp file renamed at the end; counts by status."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    tally: dict[str, int] = {}
    try:
        with temp.open("w", encoding="utf-8") as handle:
            path = f"/v1/batches/{batch_id}/results"
            for page in client.pages(path, {"page_size": page_size}):
                for item in page.get("results") or []:
                    handle.write(json.dumps(item) + "\n")
                    status = str(item.get("status"))
                    tally[status] = tally.get(status, 0) + 1
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
    return tally


def _batch_cost_lines(batch: dict[str, Any]) -> list[str]:
    """A finished batch's model usage and cost, its lane's, how its items were ranked, and
    where their time went.

    >>> lines = _batch_cost_lines({"lane": "economy", "usage": {"requests": 1, "cost_usd": 0.5},
    ...     "rerank_outcomes": {"applied": 1}})
    >>> lines[0].endswith("$0.500000 (economy lane: half price)"), lines[1]
    (True, 'rerank: applied 1, fallback 0, skipped 0')
    """
    usage, outcomes = batch.get("usage"), batch.get("rerank_outcomes") or {}
    if usage is None:  # a gateway from before batches told their usage
        return []
    lane = batch.get("lane") or "standard"
    price = " (economy lane: half price)" if lane == "economy" else ""
    ranked = ", ".join(
        f"{name} {outcomes.get(name, 0)}" for name in ("applied", "fallback", "skipped")
    )
    lines = [usage_line(usage) + price, f"rerank: {ranked}"]
    stages = batch.get("stage_seconds") or {}
    if stages:
        spent = ", ".join(f"{name.replace('_', ' ')} {s:.2f}" for name, s in stages.items())
        lines.append(f"seconds by stage, summed over the items: {spent}")
    return lines


@app.command("batch")
def batch(
    queries: Annotated[Path, typer.Argument(help="queries.jsonl: BEIR (_id,text) or Sift's")],
    index: Annotated[str, typer.Option("--index", callback=index_name, help="the index to search")],
    out: Annotated[Path, typer.Option("--out", help="where to write RESULTS.jsonl")],
    limit: Annotated[
        int | None, typer.Option(min=1, max=MAX_LIMIT, help="hits per query, if a line has none")
    ] = None,
    mode: Annotated[str | None, typer.Option(help="fts, vector or hybrid, if a line has none")] = (
        None
    ),
    rerank: Annotated[
        bool | None,
        typer.Option("--rerank/--no-rerank", help="override the server's default"),
    ] = None,
    lane: Annotated[str, typer.Option(help="standard or economy")] = "standard",
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
) -> None:
    """Submit a batch of searches, show progress while it runs, and write every result."""
    console = _out()
    with _expected_errors():
        if mode is not None and mode not in MODES:
            raise InputError(f"--mode: one of {', '.join(MODES)} is required, not {mode!r}")
        if lane not in LANES:
            raise InputError(f"--lane: one of {', '.join(LANES)} is required, not {lane!r}")
        loaded = _load(queries, query_from, skip_invalid=skip_invalid, unique_ids=True)
        _report_skipped(console, loaded.problems)
        items = loaded.records
        if not items:
            raise InputError(f"{queries}: no queries to send")
        if len(items) > MAX_BATCH_QUERIES:
            raise InputError(f"{queries}: {len(items)} queries; a batch holds {MAX_BATCH_QUERIES}")
        _check_out(out)
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
            try:
                # one key for every resend: a submit whose answer was lost (the gateway
                # restarting) is answered with the batch it made, never made twice. A send
                # whose gateway died between claiming the key and making the batch leaves
                # it 409 "in progress" for the pending marker's life from that claim, which
                # may come late in the window: the submit outwaits it
                key = {"Idempotency-Key": f"sift-batch-{uuid.uuid4().hex}"}
                window = RETRY_SECONDS + IDEMPOTENCY_PENDING_TTL_SECONDS
                submitted = client.json(
                    "POST", "/v1/batches", json=body, headers=key, retry_for=window
                )
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
                    "`sift batches --limit 1` shows it, DELETE /v1/batches/{id} cancels it",
                    soft_wrap=True,
                )
                raise typer.Exit(EXIT_INTERRUPTED) from None
            batch_id = str(submitted["id"])
            console.print(f"batch [bold]{batch_id}[/]: {len(items)} queries submitted")
            with _cancel_on_interrupt(client, batch_id), progress_bar(console) as progress:
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
                        f"results file written (DELETE /v1/batches/{batch_id} cancels it)"
                    ) from exc
            try:
                tally = _write_results(client, batch_id, out, page_size)
            except KeyboardInterrupt:  # the batch is final: nothing to cancel, all to read
                _err().print(
                    f"interrupted while writing the results: batch {batch_id} has finished; "
                    f"nothing was written to {plain(out)}; GET /v1/batches/{batch_id}/results "
                    "pages its results",
                    soft_wrap=True,
                )
                raise typer.Exit(EXIT_INTERRUPTED) from None
            except OSError as exc:  # writable when checked, not now (a full disk...)
                raise InputError(
                    f"--out: cannot write {out} ({exc.strerror or exc}); batch {batch_id} has "
                    f"finished: GET /v1/batches/{batch_id}/results pages its results"
                ) from exc
        written = sum(tally.values())
        counts = final.get("counts") or {}
        total = int(counts.get("total") or len(items))
        elapsed = time.monotonic() - started
        parts = [f"{name} {tally.get(name, 0)}" for name in ("succeeded", "failed", "canceled")]
        console.print(
            f"wrote {written} result(s) to [bold]{plain(out)}[/] in {elapsed:.1f} s: "
            + ", ".join(parts)
        )
        for line in _batch_cost_lines(final):
            console.print(line)
        if written != total:
            raise GatewayError(f"batch {batch_id}: {total} queries but {written} results returned")
        not_ok = tally.get("failed", 0) + tally.get("canceled", 0)
        if not_ok:
            _err().print(
                f"[bold red]{tally.get('failed', 0)} failed, {tally.get('canceled', 0)} canceled[/]"
                f" of {total}; see the error of each in {plain(out)}"
            )
            if strict:
                raise typer.Exit(EXIT_ITEMS_FAILED)
