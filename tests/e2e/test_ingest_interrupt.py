"""Ctrl-C (SIGINT) during ``sift ingest``, run as a user runs it (its own process, the real
gateway and worker): it says what the gateway acknowledged as indexed and the line to
resume from, and exits 130; a SIGTERM the same, exit 143.

Before, it exited 130 with nothing said, not what was in nor where to go on from; and
against a gateway whose jobs did not run (a backlog, workers down) it did not exit at all:
the pool waited for a request still polling its job.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import ACME, Stack
from tests.services import SHUTDOWN_POLL_SECONDS, free_port

KEY = ACME["Authorization"].split()[1]
RESUME = re.compile(r"resume from line (\d+) \(document '([^']+)'\)")


def _restore_sigint() -> None:
    """A child of a shell's background job inherits SIGINT ignored, and Python then keeps
    ignoring it: the child is given the default, so that SIGINT is Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def sift_ingest(
    url: str, corpus: Path, index: str, *args: str, out: Path | None = None
) -> Iterator[_Running]:
    """``sift ingest`` of ``corpus`` into ``index`` at ``url``, its stdout written to ``out``
    (None: dropped)."""
    env = {"SIFT_URL": url, "SIFT_API_KEY": KEY, "COLUMNS": "200", "NO_COLOR": "1",
           "HOME": os.environ.get("HOME", "/tmp")}  # fmt: skip
    command = [sys.executable, "-m", "worker.cli", "ingest", str(corpus), "--index", index]
    stdout = subprocess.DEVNULL if out is None else out.open("w")
    proc = subprocess.Popen(
        [*command, *args],
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_restore_sigint,
    )
    running = _Running(proc)
    try:
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        running.join()
        if out is not None:
            stdout.close()


class _Running:
    """A ``sift`` process, its stderr read as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def join(self) -> None:
        self._reader.join(timeout=10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()

    def stderr(self) -> str:
        return " ".join("".join(self.err).split())

    def until(self, ready: Callable[[], bool], what: str, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            assert self.proc.poll() is None, (what, self.proc.returncode, self.stderr())
            assert time.monotonic() < deadline, (what, self.stderr())
            time.sleep(0.05)

    def finish(self, seconds: float = 90) -> int:
        try:
            return self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"sift ingest did not exit: {self.stderr()}") from None


def _corpus(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    """A corpus of ``n`` documents, whose ids and file name read as rich markup if printed
    as such (``[/]`` closes nothing: MarkupError; ``[red]`` is a style, not shown)."""
    ids = [f"c{i}[/]" for i in range(n)]
    corpus = tmp_path / "[red]corpus.jsonl"  # line 1 blank: the line numbers are the file's
    corpus.write_text(
        "\n" + "".join(json.dumps({"id": i, "text": f"pangolin scales {i}"}) + "\n" for i in ids)
    )
    return corpus, ids


def _indexed(stack: Stack, index: str) -> set[str]:
    found: set[str] = set()
    params: dict[str, Any] = {"page_size": 1000}
    while True:
        page = stack.live.get(f"/v1/indexes/{index}/documents", params=params, headers=ACME)
        if page.status_code == 404:
            return found
        body = page.json()
        found |= {d["id"] for d in body["documents"]}
        if not body["next_page_token"]:
            return found
        params["page_token"] = body["next_page_token"]


def test_ctrl_c_says_what_the_gateway_acknowledged_and_the_line_to_resume_from(
    stack: Stack, tmp_path: Path
) -> None:
    """SIGINT once some requests were answered: the requests in flight are waited for, no
    other is sent, and the note names the line before which every document is indexed, and
    the file and document as written (they were printed as markup: a MarkupError's
    traceback for an id with ``[/]``, a file name's ``[red]`` left out)."""
    corpus, ids = _corpus(tmp_path, 600)
    index = "cli-interrupted"
    with sift_ingest(stack.live_url, corpus, index, "--batch-size", "2") as sift:
        sift.until(lambda: len(_indexed(stack, index)) >= 6, "six documents indexed")
        sift.proc.send_signal(signal.SIGINT)
        code = sift.finish()
        err = sift.stderr()
    assert code == 130, err
    assert "interrupted" in err and "send the whole file again" in err, err
    assert f"of {corpus} known indexed" in err, err
    found = RESUME.search(err)
    assert found is not None, err
    line, document = int(found[1]), found[2]
    assert document == ids[line - 2], (line, document)  # line 1 is blank
    before = set(ids[: line - 2])
    indexed = _indexed(stack, index)
    assert before <= indexed, sorted(before - indexed)[:5]  # true: every one before is in
    known = int(re.search(r"(\d+) of 600 document\(s\)", err)[1])  # type: ignore[index]
    assert len(before) <= known <= len(indexed), (len(before), known, len(indexed))
    assert len(indexed) < len(ids), "the whole file was sent: the interrupt stopped nothing"
    settled = len(_indexed(stack, index))
    time.sleep(1)
    assert len(_indexed(stack, index)) == settled  # nothing was left in flight


def test_sigterm_is_taken_as_ctrl_c_with_its_own_exit_status(stack: Stack, tmp_path: Path) -> None:
    """SIGTERM (a ``kill``, a supervisor, a CI timeout) killed ``sift ingest`` at once, rc
    -15, saying nothing of what was indexed. It now stops as a Ctrl-C does, the requests in
    flight waited for and the line to resume from said, and exits 143 (128 + SIGTERM); its
    ``--json`` summary says so too."""
    corpus, ids = _corpus(tmp_path, 600)
    index = "cli-terminated"
    out = tmp_path / "summary.json"
    with sift_ingest(stack.live_url, corpus, index, "--batch-size", "2", "--json", out=out) as sift:
        sift.until(lambda: len(_indexed(stack, index)) >= 6, "six documents indexed")
        sift.proc.send_signal(signal.SIGTERM)
        code = sift.finish()
        err = sift.stderr()
    assert code == 143, err
    assert "terminated" in err and f"of {corpus} known indexed" in err, err
    found = RESUME.search(err)
    assert found is not None, err
    line = int(found[1])
    assert set(ids[: line - 2]) <= _indexed(stack, index)
    assert len(_indexed(stack, index)) < len(ids), "the whole file was sent"
    summary = json.loads(out.read_text())
    assert summary["status"] == "terminated" and summary["resume_from_line"] == line, summary
    assert summary["documents"] == 600 and summary["known_indexed"] < 600, summary


class _Relay(http.server.ThreadingHTTPServer):
    """In front of a gateway: each request forwarded, and the status of each answer kept;
    with ``no_wait``, a request's ``wait=30`` made ``wait=0``, so an ingest is answered
    ``202`` at once and its job polled."""

    def __init__(self, target: str, no_wait: bool) -> None:
        super().__init__(("127.0.0.1", free_port()), _RelayHandler)
        self.target = target
        self.no_wait = no_wait
        self.statuses: list[int] = []

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that left before its answer (sift leaving at a second Ctrl-C)


class _RelayHandler(http.server.BaseHTTPRequestHandler):
    server: _Relay

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        path = self.path.replace("wait=30", "wait=0") if self.server.no_wait else self.path
        answer = httpx.request(
            self.command, self.server.target + path, headers=headers, content=body, timeout=60
        )
        self.server.statuses.append(answer.status_code)
        self.send_response(answer.status_code)
        self.send_header("content-type", answer.headers.get("content-type", "application/json"))
        self.send_header("content-length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    do_GET = do_POST = _forward


@contextmanager
def relay(target: str, *, no_wait: bool) -> Iterator[tuple[str, _Relay]]:
    server = _Relay(target, no_wait)
    thread = threading.Thread(
        target=server.serve_forever, args=(SHUTDOWN_POLL_SECONDS,), daemon=True
    )
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host!s}:{port}", server
    finally:
        server.shutdown()
        server.server_close()


def _idle_jobs(stack: Stack, index: str) -> list[str]:
    listed = stack.idle.get("/v1/ingestions", headers=ACME).json()["ingestions"]
    return [job["id"] for job in listed if job["index"] == index]


def test_ctrl_c_names_the_jobs_sent_whose_outcome_is_not_known(
    stack: Stack, tmp_path: Path
) -> None:
    """SIGINT while the two requests' jobs are polled, on the idle gateway (no worker: they
    stay queued). The polls stop, and the note says those jobs may still index their
    documents, naming each. It said "none of the 10 document(s) ... is known indexed"
    alone, as if nothing sent would be: the jobs ran once a worker came."""
    corpus, _ = _corpus(tmp_path, 10)
    index = "cli-interrupted-polled"
    with (
        relay(stack.idle_url, no_wait=True) as (url, _),
        sift_ingest(url, corpus, index, "--batch-size", "5") as sift,
    ):
        sift.until(lambda: len(_idle_jobs(stack, index)) == 2, "both requests made their jobs")
        sift.proc.send_signal(signal.SIGINT)
        code = sift.finish(seconds=60)
        err = sift.stderr()
    assert code == 130, err
    assert "none of the 10 document(s)" in err and "known indexed" in err, err
    jobs = _idle_jobs(stack, index)
    assert "may still index" in err and all(job in err for job in jobs), (jobs, err)


def test_ctrl_c_twice_leaves_at_once_with_what_is_known(stack: Stack, tmp_path: Path) -> None:
    """Against a gateway whose jobs do not run (the idle one: no worker), the request in
    flight waits out its ``?wait=``: the first SIGINT says it waits for it, the second leaves
    at once, saying nothing is known indexed, from line 2."""
    corpus, _ = _corpus(tmp_path, 10)
    index = "cli-interrupted-twice"

    def submitted() -> bool:
        listed = stack.idle.get("/v1/ingestions", headers=ACME).json()["ingestions"]
        return any(job["index"] == index for job in listed)

    with sift_ingest(stack.idle_url, corpus, index, "--batch-size", "5") as sift:
        sift.until(submitted, "the first request made its job")
        sift.proc.send_signal(signal.SIGINT)
        sift.until(lambda: "Ctrl-C again" in sift.stderr(), "the wait is announced")
        sift.proc.send_signal(signal.SIGINT)
        code = sift.finish(seconds=20)  # the request in flight holds it up to 30 s
        err = sift.stderr()
    assert code == 130, err
    assert "none of the 10 document(s)" in err and "known indexed" in err, err
    assert "may still be indexed" in err, err


def _over_the_idle_limit(tmp_path: Path) -> Path:
    """A document alone over the idle gateway's body limit (64 KiB), on line 1, then four
    that fit: with ``--batch-size 1`` the first request is refused (413) while the second's
    job is made, and stays queued (and the third's, when the refused request's thread takes
    it up before the failure is seen)."""
    corpus = tmp_path / "corpus.jsonl"
    lines = [{"id": "huge", "text": "y" * 70_000}] + [
        {"id": f"s{i}", "text": f"numbat {i}"} for i in range(4)
    ]
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return corpus


def test_a_failed_ingest_does_not_wait_on_a_job_that_does_not_run(
    stack: Stack, tmp_path: Path
) -> None:
    """The first request refused, the one sent alongside it has a job the idle gateway never
    runs: the failure is told once that request is answered, naming its job as one that may
    still index its documents. The pool waited on that job's poll for good: nothing was
    said, and the command never exited (a Ctrl-C then lost the failure: the next test)."""
    index = "cli-failed-unrun"
    with (
        relay(stack.idle_url, no_wait=True) as (url, _),
        sift_ingest(url, _over_the_idle_limit(tmp_path), index, "--batch-size", "1") as sift,
    ):
        code = sift.finish(seconds=60)
        err = sift.stderr()
    assert code == 1, err
    assert "'huge' alone is larger" in err and "none of the 5 document(s)" in err, err
    jobs = _idle_jobs(stack, index)
    assert jobs and "may still index" in err and all(job in err for job in jobs), (jobs, err)


def test_ctrl_c_while_a_failure_waits_on_a_request_still_says_the_failure(
    stack: Stack, tmp_path: Path
) -> None:
    """SIGINT while a failed ingest waits for the request sent alongside (its ``?wait=`` on
    the idle gateway): it leaves, saying why the ingest failed and what is known indexed.
    It said "interrupted again" (once pressed) with the failure, its reason, left out."""
    index = "cli-failed-interrupted"
    corpus = _over_the_idle_limit(tmp_path)
    with (
        relay(stack.idle_url, no_wait=False) as (url, server),
        sift_ingest(url, corpus, index, "--batch-size", "1") as sift,
    ):
        sift.until(lambda: 413 in server.statuses, "the first request refused")
        sift.until(lambda: bool(_idle_jobs(stack, index)), "the second request's job made")
        # the command's main thread has taken the 413 from its request's thread (a SIGINT
        # before that is a plain Ctrl-C, no failure yet): it says it waits on the other
        sift.until(lambda: "a request failed: waiting" in sift.stderr(), "the failure taken")
        sift.proc.send_signal(signal.SIGINT)
        code = sift.finish(seconds=45)  # the request in flight holds it up to 30 s
        err = sift.stderr()
    assert code == 130, err
    assert "'huge' alone is larger" in err and "none of the 5 document(s)" in err, err
    assert "interrupted" in err and "again" not in err, err
