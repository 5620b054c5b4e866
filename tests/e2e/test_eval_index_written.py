"""``sift eval --index`` (and ``--tune``) of an index written while its runs go: the CLI
in-process, the real stack behind a small proxy that, before it relays the first run's batch
submit, writes one document into the index through the gateway.

Before, the runs of an index written meanwhile were scored as one: with half of a 300
document index deleted while they ran, the fused run (read after the delete) scored 0.019
against BM25's 0.054 (read before), the command advised tuning the fusion, and exited 0; a
``--tune --apply`` chose and stored weights from two rankings of two states of the index.
"""

from __future__ import annotations

import http.server
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from tests.e2e.conftest import ACME, SAMPLE, Stack, ingest
from tests.services import free_port, served
from worker.cli import app

QRELS = Path(__file__).parent / "data" / "sample_qrels.tsv"
QUERIES = SAMPLE / "sample_queries.jsonl"
KEY = ACME["Authorization"].split()[1]
INDEX = "eval-written"
_written = itertools.count()


class _Proxy(http.server.ThreadingHTTPServer):
    """Forwards every request to ``target``; runs ``before_first_submit`` once, before it
    relays the first batch submit."""

    def __init__(self, target: str, before_first_submit: Callable[[], None]) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.target, self.before_first_submit = target, before_first_submit
        self.submits = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Proxy

    def log_message(self, *args: object) -> None:
        pass

    def _relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.command == "POST" and self.path == "/v1/batches":
            self.server.submits += 1  # the CLI sends its submits one at a time
            if self.server.submits == 1:
                self.server.before_first_submit()
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        response = httpx.request(
            self.command, self.server.target + self.path, headers=headers, content=body, timeout=60
        )
        self.send_response(response.status_code)
        for name in ("content-type", "location", "idempotent-replayed"):
            if name in response.headers:
                self.send_header(name, response.headers[name])
        self.send_header("content-length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    do_GET = do_POST = do_DELETE = do_PATCH = _relay


@pytest.fixture
def proxy(stack: Stack, corpus: list[dict[str, object]]) -> Iterator[_Proxy]:
    """A proxy whose first batch submit comes after one more document of ``INDEX`` (the
    sample corpus, ingested here) was written."""
    ingest(stack, INDEX, corpus)

    def write() -> None:
        ingest(stack, INDEX, [{"id": f"written-{next(_written)}", "text": "kidney stones"}])

    with served(_Proxy(stack.live_url, write)) as server:
        yield server


def _eval(proxy: _Proxy, *args: str) -> Result:
    env = {"SIFT_URL": f"http://127.0.0.1:{proxy.server_address[1]}", "SIFT_API_KEY": KEY,
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    common = ["eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS)]
    return CliRunner().invoke(app, [*common, *args], env=env)


def test_eval_index_of_an_index_written_while_its_runs_go_says_so_and_exits_3(
    stack: Stack, proxy: _Proxy, tmp_path: Path
) -> None:
    result = _eval(proxy, "--json", str(tmp_path / "report.json"))
    assert proxy.submits == 4, proxy.submits  # bm25, knn, fused, window
    said = " ".join(result.output.split())
    assert result.exit_code == 3, result.output  # no quality gate passes on such figures
    assert f"index '{INDEX}' was written while the runs went: documents " in said, said
    assert "the runs may have read different states of it" in said, said
    assert "fusion hurts here" not in said, said  # no advice drawn from them
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["index_written"].startswith(f"index '{INDEX}' was written"), report
    assert report["failed"] == 0, report  # every search succeeded: the write is what it says


def test_eval_tune_of_an_index_written_while_its_rankings_are_read_applies_nothing(
    stack: Stack, proxy: _Proxy
) -> None:
    before = stack.live.get(f"/v1/indexes/{INDEX}", headers=ACME).json()["settings"]
    result = _eval(proxy, "--tune", "--apply")
    said = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert f"index '{INDEX}' was written while its rankings were read" in said, said
    assert "applied to" not in said, said
    after = stack.live.get(f"/v1/indexes/{INDEX}", headers=ACME).json()["settings"]
    assert after == before
