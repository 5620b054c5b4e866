"""``sift index delete`` and ``sift documents delete`` as a user meets them, through a proxy in
front of the real gateway: a Ctrl-C while they wait for the delete job, a 503 (Redis
restarting, a proxy's) on their first request, the first request's answer lost after the
gateway made its job (a proxy's 504), or the real gateway's ``503 job_store_full`` (its Redis
at maxmemory); and the reads of ``sift index show`` and ``sift documents get``, and ``sift
index set``'s PATCH, through the same 503.

The Ctrl-C test's gateway is the stack's idle one (no worker on its Redis database): the delete
job it accepts stays queued, and the proxy answers at once (``?wait=`` dropped), so the command
is polling the job when the signal comes. Before, it exited 130 with nothing said, though
the job runs on at the server (``sift search`` says so of its search)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import pytest
import redis
from typer.testing import CliRunner

from tests.e2e.conftest import ACME, Stack, ingest
from tests.reliability.support import wait_for
from tests.services import free_port, served
from worker.cli import _http, app
from worker.processes.stack import child_env

DOCS = [{"id": "d1", "text": "okapi forest giraffe"}, {"id": "d2", "text": "pangolin scales"}]
FORWARDED = ("authorization", "content-type", "idempotency-key")  # the headers the proxy sends on


class _Proxy(http.server.ThreadingHTTPServer):
    """Forwards every request to ``target``; ``?wait=`` dropped when ``no_wait``; the first
    request of each (method, path) answered 503 when ``fail_first`` (not forwarded), or
    forwarded and its answer lost, a 504 in its place, when ``lose_first`` (a proxy's read
    timeout shorter than the request's wait), or forwarded while ``fill_first``'s Redis is
    full (its maxmemory set below what it holds, and set back after the answer). Keeps what
    it saw."""

    def __init__(
        self, target: str, *, no_wait: bool = False, fail_first: bool = False,
        lose_first: bool = False, fill_first: redis.Redis | None = None,
    ) -> None:  # fmt: skip
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.target = target
        self.no_wait = no_wait
        self.fail_first = fail_first
        self.lose_first = lose_first
        self.fill_first = fill_first
        self.heard: list[tuple[str, str, int]] = []  # method, path, the status answered
        self.jobs: list[str] = []  # the ids of the jobs the gateway accepted
        self.polled = threading.Event()  # a GET /v1/ingestions/{id} came
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Proxy

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        parts = urlsplit(self.path)
        query = [
            (k, v) for k, v in parse_qsl(parts.query) if not (self.server.no_wait and k == "wait")
        ]
        with self.server.lock:
            first = (self.command, parts.path) not in {(m, p) for m, p, _ in self.server.heard}
        retry_after: str | None = "1"
        if self.server.fail_first and first:
            status, content = 503, b'{"error": {"type": "unavailable", "message": "restarting"}}'
        else:
            if parts.path.startswith("/v1/ingestions/"):
                self.server.polled.set()
            full = self.server.fill_first if first else None
            if full is not None:
                full.config_set("maxmemory", int(full.info("memory")["used_memory"]) // 2)
            try:
                answer = httpx.request(
                    self.command, self.server.target + parts.path, params=urlencode(query),
                    content=body, headers={k: v for k, v in self.headers.items()
                                           if k.lower() in FORWARDED},
                    timeout=60,
                )  # fmt: skip
            finally:
                if full is not None:
                    full.config_set("maxmemory", 0)
            status, content = answer.status_code, answer.content
            retry_after = answer.headers.get("retry-after")
            if status == 202 or (status == 200 and self.command in ("DELETE", "POST")):
                self.server.jobs.append(json.loads(content)["id"])  # a delete job's answer
            if self.server.lose_first and first:
                status, content = 504, b"gateway timeout"
        with self.server.lock:
            self.server.heard.append((self.command, parts.path, status))
        self.send_response(status)
        if status == 503 and retry_after is not None:
            self.send_header("retry-after", retry_after)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = do_DELETE = do_PATCH = _forward


def _env(url: str) -> dict[str, str]:
    key = ACME["Authorization"].split()[1]
    return {"SIFT_URL": url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}


def _deletes(index: str) -> list[tuple[str, ...]]:
    """The two delete commands, each a case of every test here: ``d1`` of ``index``, and
    ``index`` itself."""
    return [("documents", "delete", "d1", "--index", index), ("index", "delete", index, "--yes")]


def _assert_ran(stack: Stack, job: str) -> None:
    """The delete job ``job`` the gateway made ran, and deleted."""
    ran = stack.live.get(f"/v1/ingestions/{job}", headers=ACME).json()
    assert ran["status"] == "succeeded" and ran["deleted"] >= 1, ran


@pytest.fixture
def idle_proxy(stack: Stack) -> Iterator[_Proxy]:
    with served(_Proxy(stack.idle_url, no_wait=True)) as server:
        yield server


@pytest.mark.parametrize("args", _deletes("cli-ctrl-c"), ids=" ".join)
def test_ctrl_c_while_a_delete_waits_says_the_job_runs_on(
    idle_proxy: _Proxy, args: tuple[str, ...]
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", *args],
        env=child_env(_env(idle_proxy.url), inherit_sift=False),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(idle_proxy.polled.is_set, "the command polling its delete job", 60)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    [job] = idle_proxy.jobs
    said = " ".join(err.split())
    assert f"interrupted: delete job {job} runs on" in said, err
    assert f"GET /v1/ingestions/{job}" in said and "sift ingestions" in said, err
    assert "Traceback" not in err, err


@pytest.fixture
def flaky_proxy(stack: Stack) -> Iterator[_Proxy]:
    with served(_Proxy(stack.live_url, fail_first=True)) as server:
        yield server


def test_reads_settings_and_deletes_go_through_a_503(stack: Stack, flaky_proxy: _Proxy) -> None:
    """Each command's first request is answered 503 (Redis restarting, a proxy's): a read or
    a merge patch, safe to send again, is sent again, as every other command's read is (they
    stopped at the first, exit 1), and so is a delete's submission, with its Idempotency-Key
    (it stopped there, saying the delete may have run: a 503 does not prove the gateway made
    no job, and a second one, sent without a key, deleted nothing)."""
    ingest(stack, "cli-503", DOCS)
    for args in (
        ("index", "show", "cli-503"),
        ("index", "set", "cli-503", "--knn-weight", "0.5"),
        ("documents", "get", "d1", "--index", "cli-503"),
        *_deletes("cli-503"),
    ):
        before = len(flaky_proxy.heard)
        result = CliRunner().invoke(app, list(args), env=_env(flaky_proxy.url))
        assert result.exit_code == 0, (args, result.output)
        statuses = [status for _, _, status in flaky_proxy.heard[before:]]
        assert statuses[:2] == [503, 200], (args, flaky_proxy.heard[before:])
    ran = [stack.live.get(f"/v1/ingestions/{job}", headers=ACME).json() for job in flaky_proxy.jobs]
    assert [job["deleted"] for job in ran] == [1, 1], ran  # d1, then the index's one left: d2
    shown = stack.live.get("/v1/indexes/cli-503", headers=ACME)
    assert shown.status_code == 404, shown.text


@pytest.fixture
def losing_proxy(stack: Stack) -> Iterator[_Proxy]:
    with served(_Proxy(stack.live_url, lose_first=True)) as server:
        yield server


@pytest.mark.parametrize("args", _deletes("cli-lost"), ids=" ".join)
def test_a_delete_whose_answer_was_lost_is_sent_again_and_gets_its_job(
    stack: Stack, losing_proxy: _Proxy, args: tuple[str, ...]
) -> None:
    """The gateway made the delete job and ran it; a proxy in front lost its answer (a 504).
    The command sends it again with its Idempotency-Key, and the gateway answers with the job
    it made: one job, its documents gone, exit 0. Sent with no key, it stopped there saying
    the delete may have been accepted (exit 1); sent again without one (93080cd), a second job
    deleted 0, and the command said the index did not exist."""
    ingest(stack, "cli-lost", DOCS)
    result = CliRunner().invoke(app, list(args), env=_env(losing_proxy.url))
    said = " ".join(result.output.split())
    assert result.exit_code == 0, said
    sent = [status for method, _, status in losing_proxy.heard if method != "GET"]
    assert sent == [504, 200], losing_proxy.heard
    first, again = losing_proxy.jobs  # the job the gateway made, and the one it answered again
    assert first == again, losing_proxy.jobs
    _assert_ran(stack, first)
    deleted = 1 if args[0] == "documents" else 2
    assert f"deleted {deleted} document(s) from index cli-lost" in said, said
    left = stack.live.get("/v1/indexes/cli-lost/documents/d1", headers=ACME)
    assert left.status_code == 404, left.text


@pytest.fixture
def filling_proxy(stack: Stack) -> Iterator[_Proxy]:
    full = redis.Redis.from_url(stack.redis_url + "/0")
    try:
        with served(_Proxy(stack.live_url, fill_first=full)) as server:
            yield server
    finally:
        full.config_set("maxmemory", 0)
        full.close()


@pytest.mark.parametrize("args", _deletes("cli-full"), ids=" ".join)
def test_a_delete_the_gateway_refused_as_the_job_store_is_full_is_sent_again(
    stack: Stack, filling_proxy: _Proxy, args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real gateway, its Redis at maxmemory, answers the delete ``503 job_store_full``:
    Redis refused the job's writes, so no job was made, and the command sends it again once
    room is made (here at once: the 30 s ``Retry-After`` waited 0.1 s). It stopped there
    (exit 1, "may have been accepted"), as after a ``503 unavailable``, which may follow a
    job made."""
    monkeypatch.setattr(_http, "MAX_RETRY_AFTER_SECONDS", 0.1)
    ingest(stack, "cli-full", DOCS)
    result = CliRunner().invoke(app, list(args), env=_env(filling_proxy.url))
    said = " ".join(result.output.split())
    assert result.exit_code == 0, said
    sent = [status for method, _, status in filling_proxy.heard if method != "GET"]
    assert sent == [503, 200], filling_proxy.heard
    [job] = filling_proxy.jobs  # the second request's: the first made none
    _assert_ran(stack, job)
    left = stack.live.get("/v1/indexes/cli-full/documents/d1", headers=ACME)
    assert left.status_code == 404, left.text
