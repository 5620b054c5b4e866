"""``sift eval --index`` through a gateway that fails under it (the CLI in-process, the real
stack behind a small proxy that answers one batch submit itself).

Before, each run's batch was sent once, with no ``Idempotency-Key``: one ``503`` (a gateway or
Redis restarting) stopped the command, exit 1, with the runs submitted before it running on,
unnamed, spending their searches (a reranked run, its model calls). Now a submit is sent
again with its key through such failures, as ``sift batch`` does; and a failure that stops
the command cancels the runs already submitted, saying so.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from tests.e2e.conftest import ACME, INDEX, SAMPLE, Stack
from tests.services import free_port, served
from worker.cli import app

QRELS = Path(__file__).parent / "data" / "sample_qrels.tsv"
QUERIES = SAMPLE / "sample_queries.jsonl"
KEY = ACME["Authorization"].split()[1]


class _Proxy(http.server.ThreadingHTTPServer):
    """Forwards every request to ``target``, except that the second batch submit is answered
    ``refuse`` (a status) by the proxy itself, once."""

    def __init__(self, target: str, refuse: int) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.target, self.refuse = target, refuse
        self.lock = threading.Lock()
        self.submits: list[str | None] = []  # each submit's Idempotency-Key


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Proxy

    def log_message(self, *args: object) -> None:
        pass

    def _relay(self, body: bytes | None) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        response = httpx.request(
            self.command, self.server.target + self.path, headers=headers, content=body, timeout=60
        )
        self._answer(response.status_code, response.content, response.headers)

    def _answer(self, status: int, content: bytes, headers: httpx.Headers | None = None) -> None:
        self.send_response(status)
        for name in ("content-type", "location", "idempotent-replayed"):
            if headers is not None and name in headers:
                self.send_header(name, headers[name])
        if headers is None:
            self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/v1/batches":
            with self.server.lock:
                self.server.submits.append(self.headers.get("idempotency-key"))
                refuse = len(self.server.submits) == 2
            if refuse:
                error = b'{"error": {"type": "unavailable", "message": "the proxy says no"}}'
                self._answer(self.server.refuse, error)
                return
        self._relay(body)

    def do_GET(self) -> None:
        self._relay(None)

    def do_DELETE(self) -> None:
        self._relay(None)


@pytest.fixture
def proxy(stack: Stack, request: pytest.FixtureRequest) -> Iterator[_Proxy]:
    with served(_Proxy(stack.live_url, request.param)) as server:
        yield server


def _eval(proxy: _Proxy, tmp_path: Path) -> Result:
    env = {"SIFT_URL": f"http://127.0.0.1:{proxy.server_address[1]}", "SIFT_API_KEY": KEY,
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    args = ["eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS),
            "--json", str(tmp_path / "report.json")]  # fmt: skip
    return CliRunner().invoke(app, args, env=env)


def _batches(stack: Stack) -> dict[str, str]:
    listing = stack.live.get("/v1/batches", params={"page_size": 1000}, headers=ACME).json()
    return {batch["id"]: batch["status"] for batch in listing["batches"]}


@pytest.mark.parametrize("proxy", [503], indirect=True)
def test_a_503_on_a_run_s_submit_is_sent_again_with_its_key(
    stack: Stack, corpus: object, proxy: _Proxy, tmp_path: Path
) -> None:
    before = _batches(stack)
    result = _eval(proxy, tmp_path)
    assert result.exit_code == 0, result.output
    made = set(_batches(stack)) - set(before)
    assert len(made) == 4, made  # bm25, knn, fused, window: one batch each, none twice
    keys = proxy.submits
    assert len(keys) == 5 and all(keys) and keys[1] == keys[2] and len(set(keys)) == 4, keys


@pytest.mark.parametrize("proxy", [400], indirect=True)
def test_a_failure_that_stops_the_command_cancels_the_runs_it_had_sent(
    stack: Stack, corpus: object, proxy: _Proxy, tmp_path: Path
) -> None:
    before = _batches(stack)
    result = _eval(proxy, tmp_path)
    assert result.exit_code == 1, result.output
    made = {k: v for k, v in _batches(stack).items() if k not in before}
    assert len(made) == 1, made  # the first run's; the second was refused, no third sent
    ((batch_id, status),) = made.items()
    assert f"the bm25 run's batch {batch_id}" in " ".join(result.output.split()), result.output
    assert status in ("canceled", "succeeded"), status  # canceled, unless it had finished
