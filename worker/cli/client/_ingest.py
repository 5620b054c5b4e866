"""``sift ingest``: a corpus file's documents sent in requests, two in flight, with what is
known indexed said on a failure, a Ctrl-C or a SIGTERM."""

from __future__ import annotations

import bisect
import itertools
import json
import os
import sys
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

from worker.cli._app import app
from worker.cli._common import (
    EXIT_INTERRUPTED,
    InputError,
    _err,
    _expected_errors,
    _out,
    sigterm_as_ctrl_c,
)
from worker.cli._http import (
    FINAL_STATUSES,
    RETRY_SECONDS,
    Gateway,
    GatewayError,
    gateway,
    index_name,
    json_of,
    segment,
    sift_answer,
    submit_retry_seconds,
)
from worker.cli._output import plain, progress_bar
from worker.cli.client._input import (
    Loaded,
    _jsonl,
    _load,
    _nothing_sent_on_interrupt,
    _report_skipped,
    document_from,
)
from worker.constants import MAX_DOCUMENTS_PER_REQUEST
from worker.jsonl import parsed


def _send_documents(
    client: Gateway,
    index: str,
    documents: list[dict[str, Any]],
    on_indexed: Callable[[int, int], object] = lambda n, upserted: None,
    stopping: threading.Event | None = None,
    on_unsettled: Callable[[str], object] = lambda job_id: None,
    on_job: Callable[[str, int], object] = lambda job_id, n: None,
) -> int:
    """POST one batch and wait for its ingest job; answers how many documents it upserted.

    The gateway answers 200 with the finished job when it finished within ``wait``, else
    202 with a job to poll at ``GET /v1/ingestions/{id}``. A transient failure (the gateway
    restarting, a 503, a key left in progress by a gateway that died) is sent again for
    :func:`submit_retry_seconds`, as every keyed submission is. A batch over
    the gateway's body limit (413: 500 documents of up to 100,000 characters each pass its
    32 MiB) is sent again in halves, in order; a document alone over it is named.
    ``on_indexed`` is called with the number of documents of each request whose job
    succeeded (and how many it upserted), so the documents known indexed are always the
    first ones of ``documents``; ``on_job`` with each job made, and its request's documents.
    Once ``stopping`` is set (a Ctrl-C), no request is sent and a job's poll stops: its
    documents are not known indexed, and ``on_unsettled`` is called with the id of the job,
    which may still index them.
    """
    stopping = stopping or threading.Event()  # none given: never set
    if stopping.is_set():
        return 0
    path = f"/v1/indexes/{segment(index)}/documents"
    try:
        # sent again through a gateway or Redis restart, as `sift batch` sends its submit,
        # with an Idempotency-Key of its own: a request that made its job before its answer
        # was lost gets that job back, where a second job took a newer write version than a
        # delete of its ids accepted in between, and brought them back
        response = client.request(
            "POST",
            path,
            params={"wait": 30},
            json={"documents": documents},
            headers={"Idempotency-Key": uuid.uuid4().hex},
            retry_for=submit_retry_seconds(),
        )
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
            _send_documents(client, index, part, on_indexed, stopping, on_unsettled, on_job)
            for part in (documents[:half], documents[half:])
        )
    job = sift_answer(json_of(response, "POST", path), "POST", path, ("id", "status"))
    on_job(str(job.get("id")), len(documents))
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
    upserted = int(job.get("upserted") or 0)
    on_indexed(len(documents), upserted)
    return upserted


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


class _Reread:
    """Each request's documents, read again from the file when the request is sent. The
    check of the whole file keeps each document's id and line alone, so a request's worth of
    documents is held at a time (two in flight, and one read ahead), not the file: a 110 MB
    corpus used 229 MB. Requests take theirs in any order (two threads); the file is read
    once, in order, a request read ahead kept until its thread takes it. A line that is not
    what the check read (the file changed since) is an :class:`InputError`."""

    def __init__(self, file: Path, loaded: Loaded, chunks: list[list[dict[str, Any]]]) -> None:
        self._file, self._loaded = file, loaded
        self._ends = list(itertools.accumulate(len(chunk) for chunk in chunks))
        self._lines = _jsonl(file)
        self._next = 0  # of loaded.records, the next document to read
        self._read: dict[int, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def take(self, i: int) -> list[dict[str, Any]]:
        with self._lock:
            while i not in self._read:
                self._read_next()
            return self._read.pop(i)

    def close(self) -> None:
        self._lines.close()

    def _read_next(self) -> None:
        chunk = bisect.bisect_right(self._ends, self._next)  # the request it starts
        documents: list[dict[str, Any]] = []
        for number, line in self._lines:
            if number < self._loaded.lines[self._next]:
                continue  # invalid and skipped, or before --from-line
            if number > self._loaded.lines[self._next]:  # blank now, its line passed
                raise self._changed(self._loaded.lines[self._next], "it is blank now")
            try:
                document = document_from(parsed(line))
            except ValueError as exc:
                raise self._changed(number, str(exc)) from None
            if document["id"] != self._loaded.records[self._next]["id"]:
                raise self._changed(number, f"its id is now {document['id']!r}")
            documents.append(document)
            self._next += 1
            if self._next == self._ends[chunk]:
                self._read[chunk] = documents
                return
        raise self._changed(self._loaded.lines[self._next], "the file ends before it")

    def _changed(self, line: int, why: str) -> InputError:
        return InputError(f"{self._file}:{line}: changed since the file was checked ({why})")


def _resume_note(
    file: Path,
    loaded: Loaded,
    chunks: list[list[dict[str, Any]]],
    done: list[int],
    unsettled: list[str],
    first_line: int = 1,
) -> str:
    """What a failed ``sift ingest`` is known to have indexed, and the line to go on from.
    ``done`` holds how many of each request's first documents are known indexed (a
    request's halves go in order): every line before the first one not known indexed was,
    and a later request (two are in flight) may have been too. ``unsettled``: the jobs whose
    polls were stopped before they were done, which may still index their documents.
    ``first_line``: the run's ``--from-line``, whose documents alone it counts."""
    note = _known_indexed(file, loaded, chunks, done, first_line)
    if unsettled:
        note += f"; job(s) {', '.join(unsettled)} were not done yet and may still index theirs"
    return note


def _first_not_known(chunks: list[list[dict[str, Any]]], done: list[int]) -> int:
    """In file order, the first document not known indexed (all of them: none)."""
    first = 0
    for chunk, indexed in zip(chunks, done, strict=True):
        first += indexed
        if indexed < len(chunk):
            break
    return first


def _known_indexed(
    file: Path,
    loaded: Loaded,
    chunks: list[list[dict[str, Any]]],
    done: list[int],
    first_line: int,
) -> str:
    first = _first_not_known(chunks, done)
    known, total = sum(done), len(loaded.records)
    sent = f"{file}" if first_line == 1 else f"{file} from line {first_line}"
    if first >= total:
        return f"all {total} document(s) of {sent} were indexed"
    if not known:
        return f"none of the {total} document(s) of {sent} is known indexed"
    line = loaded.lines[first]
    before = f", all those before line {line}" if first else ""
    return (
        f"{known} of {total} document(s) of {sent} known indexed{before}; resume from line "
        f"{line} (document {loaded.records[first]['id']!r}) with --from-line {line}, or send "
        "the whole file again: an ingest replaces each document by id, so those indexed are "
        "written again, not duplicated"
    )


def _leave(code: int) -> NoReturn:
    """Exit now, without joining the threads still waiting on the gateway's answers (as
    ``concurrent.futures`` does at exit, up to a request's 30 s ``?wait=``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class _Tally:
    """What the gateway answered to each request (a chunk's, in file order; its halves,
    when it was split, added up): the documents of its requests the gateway accepted (a job
    made), its jobs, how many of its first documents are known indexed and how many
    documents its jobs upserted; and the jobs whose polls a stop ended, not yet final."""

    sent: list[int]
    jobs: list[list[str]]
    done: list[int]
    upserted: list[int]
    unsettled: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, requests: int) -> _Tally:
        return cls([0] * requests, [[] for _ in range(requests)], [0] * requests, [0] * requests)

    @property
    def not_written(self) -> int:
        """The documents known indexed that their jobs did not write: a write of their ids
        accepted after theirs (a delete, or a drop of the index) had landed first."""
        return sum(self.done) - sum(self.upserted)


def _summary(
    status: str,
    error: str | None,
    *,
    file: Path,
    index: str,
    from_line: int,
    loaded: Loaded,
    chunks: list[list[dict[str, Any]]],
    tally: _Tally,
    distinct: int,
    seconds: float,
) -> dict[str, Any]:
    """``sift ingest --json``'s one object: how the run ended, and its counts. ``indexed``
    counts each line's write, as the jobs report it; ``known_indexed`` the documents whose
    job succeeded, ``not_written`` those of them a newer write of their ids held (their job
    skipped them); ``resume_from_line`` is the first line not known indexed (null: none)."""
    documents = loaded.records
    first = _first_not_known(chunks, tally.done)
    known = sum(tally.done)
    return {
        "status": status,
        "error": error,
        "index": index,
        "file": str(file),
        "from_line": from_line,
        "documents": len(documents),
        "skipped_invalid": len(loaded.problems),
        "repeated_ids": len(documents) - distinct,
        "distinct_ids": distinct,
        "sent": sum(tally.sent),
        "indexed": sum(tally.upserted),
        "known_indexed": known,
        "not_known_indexed": len(documents) - known,
        "not_written": tally.not_written,
        "jobs": [job for jobs in tally.jobs for job in jobs],
        "unsettled_jobs": list(tally.unsettled),
        "resume_from_line": loaded.lines[first] if first < len(documents) else None,
        "seconds": round(seconds, 3),
    }


def _not_written(skipped: int, index: str) -> str:
    """The summary's word on the documents whose jobs succeeded without writing them: a
    write of their ids accepted after theirs (a delete, or a drop of the index) had landed
    first, and an ingest never undoes a newer write. It said "indexed 600 document(s)" of
    a 1,000-line file, exit 0, with no word of the other 400 (a drop sent while the file
    went had voided them).

    >>> _not_written(0, "docs")
    ''
    >>> _not_written(2, "docs").endswith("their ids (a delete of them, or a drop of 'docs')")
    True
    """
    if not skipped:
        return ""
    return (
        f"; {skipped} document(s) not written: a write accepted after theirs holds their ids "
        f"(a delete of them, or a drop of {index!r})"
    )


def _check_gateway(client: Gateway) -> None:
    """One read of the caller's ingest jobs before the file is read: a gateway not running, a
    wrong key or a Redis down is told at once, not once a big file has been read and checked
    (a 110 MB corpus takes a while). A 503 (Redis restarting) is tried again, as a request."""
    try:
        client.request("GET", "/v1/ingestions", params={"page_size": 1}, retry_for=RETRY_SECONDS)
    except GatewayError as exc:
        said = exc.message.rstrip(".")
        raise GatewayError(f"{said}; nothing was sent", status_code=exc.status_code) from exc
    except KeyboardInterrupt:
        _err().print("interrupted while reaching the gateway: nothing was sent")
        raise typer.Exit(EXIT_INTERRUPTED) from None


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
    from_line: Annotated[
        int,
        typer.Option(
            "--from-line",
            min=1,
            help="send the documents of this line of the file on (the line a stopped run "
            "said to resume from); the lines before it are not read",
        ),
    ] = 1,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", help="print a summary as JSON on stdout, the progress bar on stderr"
        ),
    ] = False,
) -> None:
    """Load documents through the gateway, with a progress bar."""
    console = _err() if json_out else _out()  # stdout: the JSON alone
    with sigterm_as_ctrl_c() as signals, _expected_errors(), gateway() as client:
        _check_gateway(client)
        with _nothing_sent_on_interrupt(file, "nothing was sent"):
            loaded = _load(
                file, document_from, skip_invalid=skip_invalid, first_line=from_line, ids_only=True
            )
            _report_skipped(console, loaded.problems)
            documents = loaded.records
            if not documents:
                since = f" from line {from_line}" if from_line > 1 else ""
                raise InputError(f"{file}: no documents to send{since}")
            chunks = _chunks(documents, batch_size)
        started = time.monotonic()
        tally = _Tally.of(len(chunks))
        done, unsettled = tally.done, tally.unsettled
        stopping = threading.Event()  # Ctrl-C or a failure: no more requests, no more polls

        reader = _Reread(file, loaded, chunks)

        def send(i: int) -> int:
            if stopping.is_set():  # not read for nothing
                return 0

            def on_indexed(n: int, upserted: int) -> None:
                done[i] += n
                tally.upserted[i] += upserted

            def on_job(job_id: str, n: int) -> None:
                tally.jobs[i].append(job_id)
                tally.sent[i] += n

            return _send_documents(
                client, index, reader.take(i), on_indexed, stopping, unsettled.append, on_job
            )

        distinct = len({d["id"] for d in documents})  # a repeated id replaces its earlier line

        def say_json(status: str, error: str | None = None) -> None:
            if json_out:
                seconds = time.monotonic() - started
                summary = _summary(
                    status,
                    error,
                    file=file,
                    index=index,
                    from_line=from_line,
                    loaded=loaded,
                    chunks=chunks,
                    tally=tally,
                    distinct=distinct,
                    seconds=seconds,
                )
                typer.echo(json.dumps(summary))

        # Two requests in flight keep the worker busy while a finished job is answered and
        # the next one sent; only when no id repeats, so a repeated id's last line still wins.
        in_flight = 2 if distinct == len(documents) else 1
        try:
            with progress_bar() as progress, _pool(in_flight) as pool:
                task = progress.add_task(f"ingest {index}", total=len(documents))
                try:
                    sent = [pool.submit(send, i) for i in range(len(chunks))]
                    for chunk, reply in zip(chunks, sent, strict=True):
                        reply.result()  # its upserted count is in the tally
                        progress.advance(task, len(chunk))
                except KeyboardInterrupt:
                    stopping.set()
                    again = "Ctrl-C again" if signals.word == "interrupted" else "a second signal"
                    _err().print(
                        f"{signals.word}: waiting for the answers to the requests already "
                        f"sent ({again} to leave without them)"
                    )
                except (GatewayError, InputError):
                    # the requests in flight are answered, but not polled on: a job that
                    # did not run held the failure back for good
                    stopping.set()
                    if any(other.running() for other in sent):  # said only when so
                        _err().print(
                            "a request failed: waiting for the answers to the requests "
                            "already sent (Ctrl-C to leave without them)"
                        )
                    raise
        except (GatewayError, InputError) as exc:  # the pool has waited for those in flight
            note = _resume_note(file, loaded, chunks, done, unsettled, from_line)
            said = str(exc).rstrip(".")  # "...`sift up`.; none of" read as a typo
            say_json("failed", plain(str(exc)))
            if isinstance(exc, InputError):  # the file changed under the command
                raise InputError(f"{said}; {note}") from exc
            raise GatewayError(f"{said}; {note}", status_code=exc.status_code) from exc
        except KeyboardInterrupt as exc:  # while the requests in flight were awaited
            note = plain(_resume_note(file, loaded, chunks, done, unsettled, from_line))
            failed = exc.__context__  # the failure whose requests in flight were awaited
            why = (
                f"[bold red]error:[/] {plain(str(failed))}; then {signals.word}"
                if isinstance(failed, GatewayError | InputError)
                else f"{signals.word} again"
            )
            _err().print(
                f"{why}: {note}; the requests sent before it may still be indexed",
                soft_wrap=True,
            )
            error = plain(str(failed)) if isinstance(failed, GatewayError | InputError) else None
            say_json(signals.word, error)
            _leave(signals.code)  # the pool's threads, waiting on answers, hold an exit
        finally:
            reader.close()  # the pool has waited for its threads, or _leave has left
        if stopping.is_set():
            note = plain(_resume_note(file, loaded, chunks, done, unsettled, from_line))
            _err().print(f"{signals.word}: {note}", soft_wrap=True)
            say_json(signals.word)
            raise typer.Exit(signals.code)
        elapsed = time.monotonic() - started
        console.print(
            f"indexed [bold]{sum(tally.upserted)}[/] document(s) into [bold]{index}[/] "
            f"in {elapsed:.1f} s"
            + (f", from line {from_line} of {plain(file)}" if from_line > 1 else "")
            + (f"; skipped {len(loaded.problems)} invalid line(s)" if loaded.problems else "")
            + _not_written(tally.not_written, index)
            # each line's write is counted: the index holds one document an id
            + (
                f"; {len(documents) - distinct} line(s) repeated an earlier line's id and "
                f"replaced it: {distinct} distinct id(s)"
                if distinct < len(documents)
                else ""
            ),
            soft_wrap=True,
        )
        say_json("succeeded")
