"""A SIFT_URL that answers ``200`` with JSON that is not Sift's (another app on the port, a
proxy's catch-all page): every command stops on one line naming SIFT_URL, exit 1.

Before, most commands stopped on a traceback (``KeyError: 'indexes'``, ``'documents'``,
``'id'``), and ``sift searches`` / ``sift batches`` printed an empty list, exit 0. The service
here is a real HTTP server on its own port, answering every request ``{"ok": true}``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.reliability.support import SAMPLE
from tests.services import served
from worker.cli import app


class _OtherApp(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = do_PATCH = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def other_app() -> Iterator[str]:
    with served(ThreadingHTTPServer(("127.0.0.1", 0), _OtherApp)) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    "args",
    [
        ("indexes",),
        ("index", "show", "demo"),
        ("index", "set", "demo", "--knn-weight", "1"),
        ("index", "delete", "demo", "--yes"),
        ("documents", "list", "demo"),
        ("documents", "get", "d1", "--index", "demo"),
        ("documents", "delete", "d1", "--index", "demo"),
        ("search", "chess", "--index", "demo"),
        ("ingest", str(SAMPLE / "sample_corpus.jsonl"), "--index", "demo"),
        (
            "batch",
            str(SAMPLE / "sample_queries.jsonl"),
            "--index",
            "demo",
            "--out",
            "{tmp}/r.jsonl",
        ),
        ("searches",),
        ("batches",),
        ("ingestions",),
    ],
    ids=" ".join,
)
def test_an_answer_that_is_not_sifts_is_one_line_naming_sift_url(
    other_app: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    env = {"SIFT_URL": other_app, "SIFT_API_KEY": "sk-any", "COLUMNS": "200", "NO_COLOR": "1"}
    result = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 1, result.output
    assert "is not a Sift gateway answer (SIFT_URL)" in result.stderr, result.output
    assert result.stdout == "", result.output  # ingest's progress bar too: it is on stderr
