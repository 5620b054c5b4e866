"""``sift batch`` through a gateway that restarts under it: the CLI in-process (typer's
runner), the real stack behind a small proxy that loses what a restart loses.

The proxy forwards every request to the live gateway, except that it closes the connection
with no answer after forwarding the first ``POST /v1/batches`` (the batch was made; its
answer died with the gateway) and answers ``503`` to the first polls (the gateway, back,
finding Redis still restarting). Before, ``sift batch`` stopped at the lost answer ("Server
disconnected without sending a response", exit 1) with the batch running on: sent again, it
was made, and paid for, twice. Now it sends the one batch with an ``Idempotency-Key`` and
sends it again with the same key, waits through the 503s, and writes every result.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from typer.testing import CliRunner

from api_gateway.bodies import parse_batch
from tests.e2e.conftest import ACME, INDEX, Stack
from tests.services import SHUTDOWN_POLL_SECONDS, free_port, served
from worker.cli import app
from worker.queue.jobstore import IdempotencyOutcome, JobStore
from worker.queue.jobstore.idempotency import _idem_key

QUERIES = 12
UNAVAILABLE_POLLS = 3


class _Proxy(http.server.ThreadingHTTPServer):
    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.target = target
        self.lock = threading.Lock()
        self.batch_posts: list[str | None] = []  # each submit's Idempotency-Key
        self.polls_refused = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Proxy

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self, body: bytes | None) -> httpx.Response:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host",)}
        return httpx.request(
            self.command, self.server.target + self.path, headers=headers, content=body, timeout=60
        )

    def _answer(self, response: httpx.Response) -> None:
        self.send_response(response.status_code)
        for name in ("content-type", "retry-after", "location"):
            if name in response.headers:
                self.send_header(name, response.headers[name])
        self.send_header("content-length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        response = self._forward(body)
        if self.path == "/v1/batches":
            with self.server.lock:
                self.server.batch_posts.append(self.headers.get("idempotency-key"))
                first = len(self.server.batch_posts) == 1
            if first:  # made, and its answer lost with the gateway
                self.close_connection = True
                return
        self._answer(response)

    def do_GET(self) -> None:
        if self.path.startswith("/v1/batches/bat_") and "/results" not in self.path:
            with self.server.lock:
                refuse = self.server.polls_refused < UNAVAILABLE_POLLS
                self.server.polls_refused += refuse
            if refuse:
                error = {"type": "unavailable", "message": "the job store is unavailable"}
                self._answer(httpx.Response(503, json={"error": error}))
                return
        self._answer(self._forward(None))

    def do_DELETE(self) -> None:
        self._answer(self._forward(None))


@pytest.fixture
def proxy(stack: Stack) -> Iterator[_Proxy]:
    with served(_Proxy(stack.live_url)) as server:
        yield server


def _batch_ids(stack: Stack) -> set[str]:
    listing = stack.live.get("/v1/batches", params={"page_size": 1000}, headers=ACME).json()
    return {batch["id"] for batch in listing["batches"]}


def _sift_batch(
    proxy: _Proxy, queries: list[str], count: int, tmp_path: Path
) -> tuple[Any, list[str]]:
    """``sift batch --strict`` of ``count`` queries through ``proxy``, as a user runs it:
    its result, and the ids of the queries sent."""
    lines = [{"id": f"g{i}", "query": queries[i % len(queries)]} for i in range(count)]
    source = tmp_path / "queries.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": f"http://127.0.0.1:{proxy.server_address[1]}", "SIFT_API_KEY": key,
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    args = ["batch", str(source), "--index", INDEX, "--out", str(tmp_path / "results.jsonl")]
    result = CliRunner().invoke(app, [*args, "--strict"], env=env)
    return result, [line["id"] for line in lines]


def test_sift_batch_survives_a_lost_submit_answer_and_503_polls_with_one_batch(
    stack: Stack, corpus: object, queries: list[str], proxy: _Proxy, tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    before = _batch_ids(stack)
    result, sent = _sift_batch(proxy, queries, QUERIES, tmp_path)
    assert result.exit_code == 0, result.output
    made = _batch_ids(stack) - before
    assert len(made) == 1, made  # the resend was answered with the batch the first one made
    assert len(proxy.batch_posts) == 2 and proxy.batch_posts[0], proxy.batch_posts
    assert proxy.batch_posts[0] == proxy.batch_posts[1]  # one key for both
    assert proxy.polls_refused >= UNAVAILABLE_POLLS
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["query_id"] for r in written) == sorted(sent)
    assert {r["status"] for r in written} == {"succeeded"}


# The retry window and the pending marker's life, scaled down alike (both 120 s in Sift):
# the race is between the two, not in their size
SCALED_SECONDS = 5.0
CLAIM_AFTER_SECONDS = 3.0


class _DeadClaimHandler(_Handler):
    """The first submit is claimed (its Idempotency-Key's pending marker, as the gateway
    writes it, to live ``SCALED_SECONDS``) ``CLAIM_AFTER_SECONDS`` after it came in (a big
    body parsed first), and then its gateway dies: no batch, no answer, and the marker
    answers ``409 idempotency_key_in_progress`` until it expires. Every other request is
    forwarded."""

    def submits(self) -> bool:
        """Whether this POST is a submit the handler claims the first of."""
        return self.path == "/v1/batches"

    def fingerprint(self, body: bytes) -> str:
        """The body's fingerprint, as the gateway claims its key with it."""
        return parse_batch(body, "POST /v1/batches").fingerprint

    def do_POST(self) -> None:
        if not self.submits():
            super().do_POST()
            return
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        key = self.headers.get("idempotency-key")
        with self.server.lock:
            self.server.batch_posts.append(key)  # each submit's key
            first = len(self.server.batch_posts) == 1
        if first and key:
            time.sleep(CLAIM_AFTER_SECONDS)
            url = self.server.redis_url  # type: ignore[attr-defined]
            claim = JobStore.from_url(url).claim_idempotency("acme", key, self.fingerprint(body))
            assert claim.outcome is IdempotencyOutcome.NEW, claim
            marker = _idem_key("acme", key)
            assert redis.Redis.from_url(url).pexpire(marker, int(SCALED_SECONDS * 1000))
            self.close_connection = True
            return
        self._answer(self._forward(body))


def test_sift_batch_outwaits_the_claim_of_a_submit_whose_gateway_died(
    stack: Stack,
    corpus: object,
    queries: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submit whose gateway died between claiming its key and making the batch (or whose
    key's release was lost with Redis) leaves the key "in progress" for
    ``IDEMPOTENCY_PENDING_TTL_SECONDS`` (120 s) from that claim. The CLI retried for 120 s
    from its own first send, which came earlier: it gave up on the 409 ("retry") before the
    key was free, exit 1 and no batch made, whenever the claim came a few seconds in (a big
    body's parse). Now the submit retries for the marker's life past its own window."""
    monkeypatch.setattr("worker.cli._http.RETRY_SECONDS", SCALED_SECONDS)
    monkeypatch.setattr("worker.cli._http.IDEMPOTENCY_PENDING_TTL_SECONDS", SCALED_SECONDS)
    server = _Proxy(stack.live_url)
    server.RequestHandlerClass = _DeadClaimHandler
    server.redis_url = stack.redis_url + "/0"  # type: ignore[attr-defined]
    thread = threading.Thread(
        target=server.serve_forever, args=(SHUTDOWN_POLL_SECONDS,), daemon=True
    )
    thread.start()
    try:
        out = tmp_path / "results.jsonl"
        before = _batch_ids(stack)
        result, sent = _sift_batch(server, queries, 4, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    assert "has not created its job yet; retry after 1 s; trying again" in result.output
    assert len(_batch_ids(stack) - before) == 1
    assert len(set(server.batch_posts)) == 1 and len(server.batch_posts) > 2
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["query_id"] for r in written) == sorted(sent)
