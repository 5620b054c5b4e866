"""`sift ingest`, `sift search` and `sift batch` against a loopback stand-in gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner, Result

from worker.cli import app
from worker.processes.stack import free_port

API_KEY = "test-key-123456"

# the gateway's 503 on a Redis that does not answer (api_gateway/errors.py)
STALLED = (
    "the job store is unavailable: Redis did not answer within 10 s "
    "(SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS); retry after 1 s"
)


def hit(rank: int, doc_id: str, title: str) -> dict[str, Any]:
    return {
        "id": doc_id,
        "revision": "r1",
        "title": title,
        "text": "…",
        "metadata": {},
        "ranks": {"final": rank, "rrf": rank, "bm25": rank + 1, "knn": None},
        "scores": {"rrf": 0.03, "bm25": 7.5, "knn": None},
    }


SEARCH_RESULT = {
    "hits": [hit(1, "doc-a", "Alpha"), hit(2, "doc-b", "Beta")],
    "rerank": {"applied": True, "policy": "listwise.v1", "fallback_reason": None},
    "usage": {
        "requests": 1,
        "input_tokens": 1200,
        "output_tokens": 40,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cost_usd": 0.0014,
    },
}


@dataclass
class FakeGateway:
    """Answers like the gateway of DESIGN.md §9 and records what it was sent."""

    server: ThreadingHTTPServer
    requests: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)
    keep_bodies: bool = True  # False: each request kept without its body
    polls: dict[str, int] = field(default_factory=dict)
    batch_queries: list[dict[str, Any]] = field(default_factory=list)
    search_answers_at_once: bool = False
    searches_unavailable: int = 0  # the first search submits answered 503 (Redis down)
    ingests: dict[str, int] = field(default_factory=dict)
    trace: dict[str, Any] | None = None  # the result's trace when the search asks for one
    ingest_seconds: float = 0.0  # how long an ingest POST takes to answer
    ingests_in_flight: int = 0
    peak_ingests_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def posted(self, path: str) -> list[Any]:
        return [body for method, p, _, body in self.requests if method == "POST" and p == path]

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: Any) -> Any:
        parts = urlsplit(raw_path)
        path, query = parts.path, parse_qs(parts.query)
        self.requests.append((method, path, headers, body if self.keep_bodies else None))
        if headers.get("authorization", "").startswith("Bearer wrong"):
            # the gateway's answer to a key it does not know (api_gateway/auth.py)
            error = {"type": "forbidden", "field": "Authorization",
                     "message": "Authorization: the API key is not valid"}  # fmt: skip
            return 403, {"error": error}
        if headers.get("authorization") != f"Bearer {API_KEY}":
            return 401, {"detail": "missing or unknown API key"}
        if method == "POST" and path.startswith("/v1/indexes/"):
            if path.split("/")[3] == "refused":
                detail = [{"loc": ["body", "documents", 0, "text"], "msg": "too long"}]
                return 422, {"detail": detail}
            with self.lock:
                self.ingests_in_flight += 1
                self.peak_ingests_in_flight = max(
                    self.peak_ingests_in_flight, self.ingests_in_flight
                )
            time.sleep(self.ingest_seconds)
            with self.lock:
                self.ingests_in_flight -= 1
                # Like the gateway: the first batch finishes within ?wait, later ones are polled.
                n = len(self.ingests) + 1
                job = {"id": f"i-{n}", "status": "queued", "upserted": None}
                self.ingests[job["id"]] = len(body["documents"])
            if n == 1:
                return 200, {**job, "status": "succeeded", "upserted": len(body["documents"])}
            return 202, job
        if method == "GET" and path == "/v1/ingestions":  # sift ingest's check, first
            return 200, {"ingestions": [], "next_page_token": None}
        if method == "GET" and path.startswith("/v1/ingestions/"):
            job_id = path.rsplit("/", 1)[1]
            return 200, {"id": job_id, "status": "succeeded", "upserted": self.ingests[job_id]}
        if method == "POST" and path == "/v1/searches":
            if query.get("wait") != ["30"]:
                return 400, {"detail": "expected wait=30"}
            if self.searches_unavailable > 0:
                self.searches_unavailable -= 1
                error = {"type": "unavailable", "field": None, "message": STALLED}
                return 503, {"error": error}
            if self.search_answers_at_once:
                result = SEARCH_RESULT
                if body.get("include_trace"):
                    result = {**SEARCH_RESULT, "trace": self.trace}
                return 200, {"id": "s-1", "status": "succeeded", "result": result}
            return 202, {"id": "s-1", "status": "queued"}
        if method == "GET" and path == "/v1/searches/s-1":
            n = self.polls["s-1"] = self.polls.get("s-1", 0) + 1
            if n < 2:
                return 200, {"id": "s-1", "status": "running"}
            return 200, {"id": "s-1", "status": "succeeded", "result": SEARCH_RESULT}
        if method == "POST" and path == "/v1/batches":
            self.batch_queries = body["queries"]
            if len({q["id"] for q in self.batch_queries}) != len(self.batch_queries):
                return 422, {"error": {"field": "queries", "message": "duplicate ids"}}
            return 202, {"id": "b-1", "status": "queued"}
        if method == "GET" and path == "/v1/batches/b-1":
            n = self.polls["b-1"] = self.polls.get("b-1", 0) + 1
            total = len(self.batch_queries)
            done = total if n >= 3 else total * n // 3
            failed = sum(1 for q in self.batch_queries if "fail" in q["id"]) if n >= 3 else 0
            counts = {
                "total": total,
                "queued": total - done,
                "running": 0,
                "succeeded": done - failed,
                "failed": failed,
                "canceled": 0,
            }
            return 200, {
                "id": "b-1",
                "status": "succeeded" if n >= 3 else "running",
                "counts": counts,
            }
        if method == "GET" and path == "/v1/batches/b-1/results":
            size = int(query["page_size"][0])
            start = int(query.get("page_token", ["0"])[0])
            page = self.batch_queries[start : start + size]
            results = []
            for q in page:
                if "fail" in q["id"]:
                    error = {"type": "rerank_failed", "message": "timeout", "retryable": False}
                    results.append({"query_id": q["id"], "status": "failed", "error": error})
                else:
                    results.append(
                        {"query_id": q["id"], "status": "succeeded", "result": SEARCH_RESULT}
                    )
            more = start + size < len(self.batch_queries)
            return 200, {"results": results, "next_page_token": str(start + size) if more else None}
        return 404, {"detail": "Not Found"}


@pytest.fixture
def fake_gateway() -> Iterator[FakeGateway]:
    box: dict[str, FakeGateway] = {}

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, answer = box["g"].handle(method, self.path, headers, body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: object) -> None:
            pass

    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box["g"] = FakeGateway(server)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield box["g"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def run(gw: FakeGateway | str, *args: str, key: str | None = API_KEY) -> Result:
    url = gw if isinstance(gw, str) else gw.url
    env = {"SIFT_URL": url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), env=env)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- ingest ---


def test_ingest_beir_corpus_in_batches(fake_gateway: FakeGateway, tmp_path: Path) -> None:
    rows = [
        {"_id": f"d{i}", "title": f"T{i}", "text": f"text {i}", "metadata": {}} for i in range(5)
    ]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "scifact", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    posted = fake_gateway.posted("/v1/indexes/scifact/documents")  # two requests in flight
    batches = sorted(posted, key=lambda b: str(b["documents"][0]["id"]))
    assert [len(b["documents"]) for b in batches] == [2, 2, 1]
    assert batches[0]["documents"][0] == {
        "id": "d0",
        "title": "T0",
        "text": "text 0",
        "metadata": {},
    }
    assert "indexed 5 document(s) into scifact" in result.output


def test_a_beir_document_with_a_title_and_no_text_is_sent_with_its_title_as_its_text(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """BEIR corpora hold documents with a title and an empty text (TREC-COVID's papers with
    no abstract): each line was refused (``field 'text'``), and ``--skip-invalid`` dropped
    the documents from the index and from every score. Sift's own shape keeps its rule."""
    rows = [
        {"_id": "d0", "title": "Aspirin and COVID-19", "text": ""},
        {"_id": "d1", "title": "Masks", "text": " \n"},
        {"_id": "d2", "title": "T2", "text": "text 2"},
    ]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "trec")
    assert result.exit_code == 0, result.output
    [batch] = fake_gateway.posted("/v1/indexes/trec/documents")
    assert batch["documents"] == [
        {"id": "d0", "title": "", "text": "Aspirin and COVID-19", "metadata": {}},
        {"id": "d1", "title": "", "text": "Masks", "metadata": {}},
        {"id": "d2", "title": "T2", "text": "text 2", "metadata": {}},
    ]
    for bad in ({"_id": "d3", "title": "", "text": ""}, {"id": "d3", "title": "T", "text": ""}):
        corpus = write_jsonl(tmp_path / "bad.jsonl", [bad])
        refused = run(fake_gateway, "ingest", str(corpus), "--index", "trec")
        assert refused.exit_code == 1 and "bad.jsonl:1: field 'text'" in refused.output, bad


def test_ingest_keeps_two_requests_in_flight_unless_an_id_repeats(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """Two requests at once keep the worker busy between jobs; a repeated id is sent in
    file order, one request at a time, so its last line is the one that stays."""
    fake_gateway.ingest_seconds = 0.2
    unique = write_jsonl(tmp_path / "u.jsonl", [{"id": f"d{i}", "text": "t"} for i in range(6)])
    result = run(fake_gateway, "ingest", str(unique), "--index", "u", "--batch-size", "1")
    assert result.exit_code == 0, result.output
    assert "indexed 6 document(s)" in result.output
    sent = sorted(b["documents"][0]["id"] for b in fake_gateway.posted("/v1/indexes/u/documents"))
    assert sent == [f"d{i}" for i in range(6)]
    assert fake_gateway.peak_ingests_in_flight == 2

    fake_gateway.peak_ingests_in_flight = 0
    rows = [{"id": "a", "text": "old"}, {"id": "b", "text": "t"}, {"id": "a", "text": "new"}]
    repeated = write_jsonl(tmp_path / "r.jsonl", rows)
    result = run(fake_gateway, "ingest", str(repeated), "--index", "r", "--batch-size", "1")
    assert result.exit_code == 0, result.output
    texts = [b["documents"][0]["text"] for b in fake_gateway.posted("/v1/indexes/r/documents")]
    assert texts == ["old", "t", "new"]
    assert fake_gateway.peak_ingests_in_flight == 1


def test_ingest_sift_shape_keeps_revision_and_metadata(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    row = {"id": "x1", "text": "hello", "title": "Hi", "revision": "7", "metadata": {"lang": "en"}}
    corpus = write_jsonl(tmp_path / "docs.jsonl", [row, "", {"id": "x2", "text": "bye"}])
    result = run(fake_gateway, "ingest", str(corpus), "--index", "mine")
    assert result.exit_code == 0, result.output
    [batch] = fake_gateway.posted("/v1/indexes/mine/documents")
    assert batch["documents"][0] == row
    assert batch["documents"][1]["id"] == "x2"


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ({"_id": "d2", "title": "no text"}, "field 'text': Field required"),
        ({"_id": "d2", "text": 7}, "field 'text': Input should be a valid string"),
        ({"id": "d2", "text": ""}, "field 'text'"),
        ({"id": "d2", "text": "x", "tilte": "typo"}, "field 'tilte'"),
        ({"text": "no id"}, "field 'id'"),
        ("{not json", "not valid JSON"),
        # json.loads kept the last: the document "b" was sent
        ('{"id": "d2", "text": "a", "text": "b"}', "field 'text': is given 2 times: give it once"),
        (
            '{"id": "d2", "text": "a", "metadata": {"k": 1, "k": 2}}',
            "field 'metadata.k': is given 2 times: give it once",
        ),
    ],
)
def test_ingest_a_bad_line_names_line_and_field_and_sends_nothing(
    fake_gateway: FakeGateway, tmp_path: Path, bad: Any, where: str
) -> None:
    rows = [{"_id": "d0", "text": "a"}, {"_id": "d1", "text": "b"}, bad, {"_id": "d3", "text": "c"}]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "scifact")
    assert result.exit_code == 1
    assert f"corpus.jsonl:3: {where}" in result.output
    assert "Traceback" not in result.output
    assert [r[:2] for r in fake_gateway.requests] == [("GET", "/v1/ingestions")]  # the check


def test_a_file_saved_with_a_utf8_byte_order_mark_is_read(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """Windows editors save UTF-8 with a BOM first: the gateway skips one in a body, as RFC
    8259 lets a parser do, and so does the CLI's reader now (its first line was "not valid
    JSON", and ``--skip-invalid`` dropped the first document)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        b'\xef\xbb\xbf{"id": "b1", "text": "bom first"}\r\n{"id": "b2", "text": "x"}\r\n'
    )
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s")
    assert result.exit_code == 0, result.output
    [batch] = fake_gateway.posted("/v1/indexes/s/documents")
    assert [d["id"] for d in batch["documents"]] == ["b1", "b2"]


def test_an_ingest_no_gateway_answers_says_only_that(tmp_path: Path) -> None:
    """No request in flight beside the one refused: the command says no gateway answers,
    not that it is "waiting for the answers to the requests already sent" (none were);
    and, the gateway checked before the file is read, that nothing was sent."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"_id": "d0", "text": "a"}])
    result = run(f"http://127.0.0.1:{free_port()}", "ingest", str(corpus), "--index", "s")
    assert result.exit_code == 1, result.output
    assert "waiting for the answers" not in result.output, result.output
    assert "Start one with `sift up`; nothing was sent" in result.output


def test_ingest_checks_the_gateway_and_its_key_before_reading_the_file(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """The gateway was first reached once the whole file was read and checked: a 110 MB
    corpus was read (and a bad line in it reported) before a wrong key or a gateway not
    running was told. They are now told first, the file not read."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"_id": "d0", "text": "a"}, "not json"])
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", key="wrong-key")
    assert result.exit_code == 1, result.output
    assert "check SIFT_API_KEY" in result.output and "corpus.jsonl:2" not in result.output
    assert "nothing was sent" in result.output, result.output
    gone = run(f"http://127.0.0.1:{free_port()}", "ingest", str(corpus), "--index", "s")
    assert gone.exit_code == 1 and "cannot connect" in gone.output, gone.output
    assert "corpus.jsonl:2" not in gone.output, gone.output


def test_ingest_skip_invalid_sends_the_rest(fake_gateway: FakeGateway, tmp_path: Path) -> None:
    rows = [{"_id": "d0", "text": "a"}, {"_id": "d1"}, {"_id": "d2", "text": "c"}]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", "--skip-invalid")
    assert result.exit_code == 0, result.output
    [batch] = fake_gateway.posted("/v1/indexes/s/documents")
    assert [d["id"] for d in batch["documents"]] == ["d0", "d2"]
    assert "skipped 1 invalid line" in result.output
    assert "corpus.jsonl:2: field 'text'" in result.output


@pytest.mark.parametrize(
    ("text", "args"),
    [("", ()), ("\n  \n\t\n", ()), ('{"id": "d0"}\n', ("--skip-invalid",))],
)
def test_ingest_of_a_file_with_no_documents_is_an_error_naming_it(
    fake_gateway: FakeGateway, tmp_path: Path, text: str, args: tuple[str, ...]
) -> None:
    """An empty file, one of blank lines only, or one whose every line ``--skip-invalid``
    skipped: "indexed 0 document(s)" and exit 0, as if a load had been made. Like ``sift
    batch`` of a file with no queries, it is an error naming the file (exit 1)."""
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text(text)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", *args)
    assert result.exit_code == 1, result.output
    assert f"{corpus}: no documents to send" in " ".join(result.output.split())
    assert "indexed" not in result.output
    assert [r[:2] for r in fake_gateway.requests] == [("GET", "/v1/ingestions")]  # the check
    queries = tmp_path / "q.jsonl"
    queries.write_text(text)
    out = tmp_path / "r.jsonl"
    batch = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(out), *args)
    assert batch.exit_code == 1 and f"{queries}: no queries to send" in batch.output


def test_skip_invalid_skips_a_line_that_is_not_json_too(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """A file cut off mid-line (a copy interrupted, a writer killed) ends in a line that is not
    JSON: --skip-invalid skips it as any bad line. Before, it stopped the command."""
    cut = '{"_id": "d3", "te'
    rows = [{"_id": "d0", "text": "a"}, "{not json", {"_id": "d2", "text": "c"}, cut]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", "--skip-invalid")
    assert result.exit_code == 0, result.output
    [batch] = fake_gateway.posted("/v1/indexes/s/documents")
    assert [d["id"] for d in batch["documents"]] == ["d0", "d2"]
    assert "skipped 2 invalid line" in result.output
    assert "corpus.jsonl:2: not valid JSON" in result.output
    assert "corpus.jsonl:4: not valid JSON" in result.output


def test_skip_invalid_skips_a_line_cut_inside_a_character(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """A file cut off mid-line is cut inside a character as often as not when the text is not
    ASCII ("café", Greek, CJK): its last line is not UTF-8, a bad line like any other. It
    stopped the command whatever --skip-invalid said ("not UTF-8 text"), after the lines
    before it had been read; without --skip-invalid it names the line."""
    good = "".join(json.dumps({"_id": f"d{i}", "text": "café"}) + "\n" for i in range(2))
    cut = b'{"_id": "d2", "text": "caf' + "é".encode()[:1]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(good.encode() + cut)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", "--skip-invalid")
    assert result.exit_code == 0, result.output
    [batch] = fake_gateway.posted("/v1/indexes/s/documents")
    assert [d["id"] for d in batch["documents"]] == ["d0", "d1"]
    assert "corpus.jsonl:3: not UTF-8 text" in result.output
    refused = run(fake_gateway, "ingest", str(corpus), "--index", "s")
    assert refused.exit_code == 1
    assert "corpus.jsonl:3: not UTF-8 text" in refused.output


def test_a_gateway_4xx_is_printed_with_its_field(fake_gateway: FakeGateway, tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "b"}])
    result = run(fake_gateway, "ingest", str(corpus), "--index", "refused")
    assert result.exit_code == 1
    assert "the gateway answered 422: documents.0.text: too long" in result.output
    assert f"none of the 1 document(s) of {corpus} is known indexed" in result.output
    assert "Traceback" not in result.output


def test_a_missing_key_is_named(fake_gateway: FakeGateway, tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "b"}])
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", key=None)
    assert result.exit_code == 1
    assert "401" in result.output and "SIFT_API_KEY is not set" in result.output
    assert "authorization" not in fake_gateway.requests[0][2]


def test_a_search_submit_answered_503_is_sent_again_with_its_key(
    fake_gateway: FakeGateway,
) -> None:
    """The gateway answers 503 while its Redis is down or restarting: ``sift search`` sends
    the search again with the same Idempotency-Key (a submit whose answer was lost is
    answered with the search it made, never run twice), as ``sift batch`` does. Before, it
    sent no key and stopped at the first 503, exit 1."""
    fake_gateway.search_answers_at_once = True
    fake_gateway.searches_unavailable = 1
    result = run(fake_gateway, "search", "what is alpha", "--index", "s")
    assert result.exit_code == 0, result.output
    assert "doc-a" in result.output and "trying again" in result.output
    assert "SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS" in result.output  # the retry line says why
    keys = [h.get("idempotency-key") for m, p, h, _ in fake_gateway.requests
            if m == "POST" and p == "/v1/searches"]  # fmt: skip
    assert len(keys) == 2 and keys[0] is not None and keys[0] == keys[1], keys


def test_a_wrong_key_names_sift_api_key(fake_gateway: FakeGateway) -> None:
    """The gateway answers a key it does not know with a 403 on ``Authorization``: the user
    is told which setting holds it (the 403 alone did not say; a missing key's 401 did)."""
    result = run(fake_gateway, "search", "q", "--index", "s", key="wrong-key")
    assert result.exit_code == 1
    printed = " ".join(result.output.split())
    assert "403: Authorization: the API key is not valid (check SIFT_API_KEY)" in printed


def test_no_gateway_listening_names_sift_url(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "b"}])
    result = run("http://127.0.0.1:9", "ingest", str(corpus), "--index", "s")
    assert result.exit_code == 1
    assert "cannot connect to the gateway at http://127.0.0.1:9 (SIFT_URL)" in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


# --- search ---


def test_search_polls_and_prints_the_ranked_hits(fake_gateway: FakeGateway) -> None:
    result = run(
        fake_gateway, "search", "what is alpha", "--index", "s", "--limit", "5", "--no-rerank"
    )
    assert result.exit_code == 0, result.output
    [body] = fake_gateway.posted("/v1/searches")
    assert body == {
        "index": "s",
        "query": "what is alpha",
        "limit": 5,
        "mode": "hybrid",
        "include_trace": False,
        "rerank": False,
    }
    assert fake_gateway.polls["s-1"] == 2
    lines = result.output.splitlines()
    row_a = next(line for line in lines if "doc-a" in line)
    assert "Alpha" in row_a and row_a.split()[1] == "1"  # "│ 1 │ doc-a …" → final rank first
    assert any("doc-b" in line and "Beta" in line for line in lines)
    assert "rerank: applied (listwise.v1)" in result.output
    assert "usage: 1 request(s), 1200 input + 40 output tokens" in result.output


def test_search_json_prints_the_raw_job(fake_gateway: FakeGateway) -> None:
    fake_gateway.search_answers_at_once = True
    result = run(fake_gateway, "search", "q", "--index", "s", "--json", "--mode", "fts")
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert job["result"]["hits"][0]["id"] == "doc-a"
    assert fake_gateway.posted("/v1/searches")[0]["mode"] == "fts"
    assert "s-1" not in fake_gateway.polls  # 200 within wait: no polling


TRACE = {
    "policy": "listwise.v1",
    "mode": "hybrid",
    "coarse_limit": 30,
    "channel_window": 60,
    "channel_counts": {"bm25": 12, "knn": 60},
    "fused_by_backend": False,
    "model": "claude-haiku-4-5",
    "candidates": [
        {"position": p, "id": f"doc-{p}", "text": f"the full text of candidate {p}"}
        for p in (1, 2, 3)
    ],
    "attempts": [{"n": 1, "outcome": "ok", "seconds": 0.8}],
    "rerank_seconds": 0.81,
    "usage": SEARCH_RESULT["usage"],
    "returned_positions": [2, 2, 7],
    "kept_positions": [2],
    "dropped_positions": [
        {"value": 2, "reason": "duplicate"},
        {"value": 7, "reason": "out_of_range"},
    ],
    "fallback_reason": None,
}


def test_search_trace_is_compact(fake_gateway: FakeGateway) -> None:
    fake_gateway.search_answers_at_once, fake_gateway.trace = True, TRACE
    result = run(fake_gateway, "search", "q", "--index", "s", "--trace")
    assert result.exit_code == 0, result.output
    assert fake_gateway.posted("/v1/searches")[0]["include_trace"] is True
    assert "kept: 2 (doc-2)" in result.output
    assert "dropped: 2 (duplicate), 7 (out_of_range)" in result.output
    assert "attempts: #1 ok 800.0 ms; rerank 810.0 ms" in result.output
    assert "the full text of candidate" not in result.output


_FIRST_529 = {"n": 1, "outcome": "http_5xx", "seconds": 0.0045, "backoff_wait_seconds": 0.0,
              "budget_wait_seconds": 0.0}  # fmt: skip


@pytest.mark.parametrize(
    ("retry", "rerank_seconds", "shown"),
    [
        # a retry that backed off and waited on the breaker before it was answered at once:
        # its own time and its waits apart (it printed the wait as the call's: '#2 ok 806.2 ms')
        (
            {"n": 2, "outcome": "ok", "seconds": 0.005, "backoff_wait_seconds": 0.2,
             "budget_wait_seconds": 0.6},
            1.01,
            "attempts: #1 http_5xx 4.5 ms, #2 ok 5.0 ms after 0.80 s waiting; rerank 1.01 s",
        ),
        # one the rate budget could not serve within the deadline is sent nothing: its
        # budget_wait_seconds is the whole wait the budget asked of it (a breaker open for a
        # minute), not slept; the back-off slept before it is (it printed '#2
        # budget_exhausted 0.0 ms after 59.65 s waiting' for a search that ran 0.2 s)
        (
            {"n": 2, "outcome": "budget_exhausted", "seconds": 0.0, "backoff_wait_seconds": 0.2,
             "budget_wait_seconds": 59.45},
            0.21,
            "attempts: #1 http_5xx 4.5 ms, #2 budget_exhausted (not sent: the budget would "
            "have held it 59.45 s in all, past the deadline) after 0.20 s waiting; rerank "
            "210.0 ms",
        ),
    ],
    ids=["answered", "budget_exhausted"],
)  # fmt: skip
def test_search_trace_tells_an_attempt_s_own_time_from_its_waits(
    fake_gateway: FakeGateway, retry: dict[str, Any], rerank_seconds: float, shown: str
) -> None:
    """A 529, then a retry: the compact trace prints each attempt's own time and what it
    waited apart."""
    trace = {**TRACE, "attempts": [_FIRST_529, retry], "rerank_seconds": rerank_seconds}
    fake_gateway.search_answers_at_once, fake_gateway.trace = True, trace
    result = run(fake_gateway, "search", "q", "--index", "s", "--trace")
    assert result.exit_code == 0, result.output
    assert shown in " ".join(result.output.split()), result.output


def test_search_trace_json_keeps_the_raw_trace(fake_gateway: FakeGateway) -> None:
    fake_gateway.search_answers_at_once, fake_gateway.trace = True, TRACE
    result = run(fake_gateway, "search", "q", "--index", "s", "--trace", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["result"]["trace"] == TRACE


def test_search_rejects_an_unknown_mode(fake_gateway: FakeGateway) -> None:
    result = run(fake_gateway, "search", "q", "--index", "s", "--mode", "semantic")
    assert result.exit_code == 2
    assert "--mode" in result.output
    assert fake_gateway.requests == []


# --- batch ---


def test_batch_writes_every_result_line(fake_gateway: FakeGateway, tmp_path: Path) -> None:
    rows: list[Any] = [{"_id": f"q{i}", "text": f"query {i}", "metadata": {}} for i in range(6)]
    rows.append({"id": "q-fail", "query": "sift shape", "limit": 3, "mode": "fts"})
    queries = write_jsonl(tmp_path / "queries.jsonl", rows)
    out = tmp_path / "out" / "results.jsonl"
    result = run(
        fake_gateway,
        "batch",
        str(queries),
        "--index",
        "s",
        "--out",
        str(out),
        "--limit",
        "7",
        "--lane",
        "economy",
        "--page-size",
        "3",
    )
    assert result.exit_code == 0, result.output
    [body] = fake_gateway.posted("/v1/batches")
    assert body["lane"] == "economy" and body["index"] == "s"
    assert body["queries"][0] == {"id": "q0", "query": "query 0", "limit": 7}
    assert body["queries"][6] == {"id": "q-fail", "query": "sift shape", "limit": 3, "mode": "fts"}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["query_id"] for r in lines] == [f"q{i}" for i in range(6)] + ["q-fail"]
    assert lines[-1]["status"] == "failed"
    assert fake_gateway.polls["b-1"] == 3
    assert "wrote 7 result(s)" in result.output
    assert "succeeded 6, failed 1, canceled 0" in result.output
    # the error types at once (before, only the count: the reason was in the file alone)
    assert "1 failed (rerank_failed 1), 0 canceled of 7" in result.output
    assert [p.name for p in out.parent.iterdir()] == ["results.jsonl"]  # no partial file left


def test_batch_strict_exits_3_when_an_item_failed(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    queries = write_jsonl(
        tmp_path / "q.jsonl", [{"id": "ok", "query": "a"}, {"id": "fail", "query": "b"}]
    )
    out = tmp_path / "r.jsonl"
    result = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(out), "--strict")
    assert result.exit_code == 3
    assert len(out.read_text().splitlines()) == 2


def test_batch_a_bad_query_line_sends_nothing(fake_gateway: FakeGateway, tmp_path: Path) -> None:
    rows = [
        {"id": "a", "query": "x"},
        {"id": "b", "query": "y", "limit": 0},
        {"id": "a", "query": "z"},
    ]
    queries = write_jsonl(tmp_path / "q.jsonl", rows)
    out = tmp_path / "r.jsonl"
    result = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(out))
    assert result.exit_code == 1
    assert "q.jsonl:2: field 'limit'" in result.output
    assert fake_gateway.requests == [] and not out.exists()
    rows[1] = {"id": "b", "query": "y"}
    write_jsonl(queries, rows)
    result = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(out))
    assert result.exit_code == 1
    assert "q.jsonl:3: field 'id': 'a' appears twice" in result.output
    queries.write_text(
        '{"id": "a", "query": "x"}\n{"id": "b", "query": "y", "limit": 3, "limit": 50}\n'
    )
    result = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(out))
    assert result.exit_code == 1
    assert "q.jsonl:2: field 'limit': is given 2 times: give it once" in result.output
    assert fake_gateway.requests == [] and not out.exists()


@pytest.mark.parametrize(
    "bad",
    [
        {"_id": "q1"},
        {"_id": "q1", "text": ""},
        {"_id": "q1", "text": " "},
        {"_id": "q1", "text": 7},
    ],
)
def test_batch_a_beir_query_line_without_its_text_names_text(
    fake_gateway: FakeGateway, tmp_path: Path, bad: dict[str, Any]
) -> None:
    """A BEIR ``queries.jsonl`` line has its query in ``text``: a line missing it (or with an
    empty one) names ``text``, the field of that line, not Sift's ``query``, which the line
    does not have."""
    queries = write_jsonl(tmp_path / "q.jsonl", [{"_id": "q0", "text": "a"}, bad])
    out = tmp_path / "r.jsonl"
    result = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(out))
    assert result.exit_code == 1
    assert "q.jsonl:2: field 'text': " in result.output, result.output
    assert "'query'" not in result.output
    assert fake_gateway.requests == [] and not out.exists()


def test_batch_summary_lines_stay_whole_when_the_output_is_not_a_terminal(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """Piped (no terminal: rich's 80 columns), each summary line is one line, as a script
    greps it. Before, "wrote N result(s) to PATH in T s: succeeded ..." broke mid-sentence
    at column 80 (and the usage line before its cost)."""
    queries = write_jsonl(tmp_path / "q.jsonl", [{"_id": "q0", "text": "query 0"}])
    out = tmp_path / ("a-folder-whose-name-is-long-enough-to-pass-eighty-columns" * 2) / "r.jsonl"
    env = {"SIFT_URL": fake_gateway.url, "SIFT_API_KEY": API_KEY, "COLUMNS": "80"}
    result = CliRunner().invoke(
        app, ["batch", str(queries), "--index", "s", "--out", str(out)], env=env
    )
    assert result.exit_code == 0, result.output
    whole = f"wrote 1 result(s) to {out} in "
    assert any(line.startswith(whole) and line.endswith("succeeded 1, failed 0, canceled 0")
               for line in result.output.splitlines()), result.output  # fmt: skip


def test_progress_bars_go_to_stderr_and_the_reports_to_stdout(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """``sift batch ... > report.txt`` and ``sift ingest ... | tee log`` keep only their
    report: the progress bar was drawn on stdout, and rich writes a bar's last frame to an
    output that is not a terminal, so it ended up in the file among the summary lines."""
    queries = write_jsonl(tmp_path / "q.jsonl", [{"_id": "q0", "text": "query 0"}])
    batch = run(fake_gateway, "batch", str(queries), "--index", "s", "--out", str(tmp_path / "r"))
    assert batch.exit_code == 0, batch.output
    assert "━" in batch.stderr and "batch s" in batch.stderr, batch.stderr
    assert "━" not in batch.stdout and "wrote 1 result(s)" in batch.stdout, batch.stdout
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "d0", "text": "t"}])
    ingest = run(fake_gateway, "ingest", str(corpus), "--index", "s")
    assert ingest.exit_code == 0, ingest.output
    assert "━" in ingest.stderr and "ingest s" in ingest.stderr, ingest.stderr
    assert "━" not in ingest.stdout and "indexed 1 document(s)" in ingest.stdout, ingest.stdout


def test_search_usage_line_stays_whole_when_the_output_is_not_a_terminal(
    fake_gateway: FakeGateway,
) -> None:
    """Before, at rich's 80 columns the usage line broke before its cost."""
    env = {"SIFT_URL": fake_gateway.url, "SIFT_API_KEY": API_KEY, "COLUMNS": "80"}
    result = CliRunner().invoke(app, ["search", "alpha", "--index", "s"], env=env)
    assert result.exit_code == 0, result.output
    [usage] = [line for line in result.output.splitlines() if line.startswith("usage: ")]
    assert usage.startswith("usage: 1 request(s), 1200 input + 40 output tokens, cache read ")
    assert "$" in usage or "unpriced" in usage, result.output


# ``sift ingest`` run as its own process, writing its peak resident memory (this process's
# own, since its exec: a forked child's ``ru_maxrss`` counts the test process it was copied from)
_PEAK = """
import atexit, re, runpy, sys
out = sys.argv.pop(1)
status = lambda: open("/proc/self/status").read()
atexit.register(lambda: open(out, "w").write(re.search(r"VmHWM:\\s+(\\d+)", status())[1]))
runpy.run_module("worker.cli", run_name="__main__")
"""


def _ingest_max_rss(gw: FakeGateway, corpus: Path, index: str) -> int:
    """The peak resident memory (KiB) of ``sift ingest`` of ``corpus`` against ``gw``."""
    env = {"SIFT_URL": gw.url, "SIFT_API_KEY": API_KEY, "HOME": os.environ.get("HOME", "/tmp"),
           "PATH": os.environ.get("PATH", ""),
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # fmt: skip
    peak = corpus.with_suffix(".peak")
    command = [sys.executable, "-c", _PEAK, str(peak), "ingest", str(corpus), "--index", index,
               "--batch-size", "50"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return int(peak.read_text())


def test_ingest_holds_a_few_requests_of_the_file_not_all_of_it(
    fake_gateway: FakeGateway, tmp_path: Path
) -> None:
    """The whole file was loaded before the first request: a 110 MB corpus used 229 MB.
    The file is now checked whole first (a bad line still stops it before anything is
    sent), keeping only each document's id and line, then read again a request's worth of
    documents at a time as they are sent: a file four times the size takes about the same
    memory (the peak grew by more than the file's size before)."""
    fake_gateway.keep_bodies = False  # the stand-in's own memory is not the command's
    text = "wombat " * 2_000  # 14 KB a document

    def corpus(name: str, n: int) -> Path:
        rows = [{"_id": f"{name}{i}", "title": f"t{i}", "text": text} for i in range(n)]
        return write_jsonl(tmp_path / f"{name}.jsonl", rows)

    small, big = corpus("small", 1_200), corpus("big", 4_800)  # 16 MB and 66 MB
    grown = _ingest_max_rss(fake_gateway, big, "big") - _ingest_max_rss(fake_gateway, small, "s")
    assert sum(fake_gateway.ingests.values()) == 1_200 + 4_800
    more = (big.stat().st_size - small.stat().st_size) // 1024
    assert grown < more // 4, (grown, more)


def test_ingest_of_a_file_changed_while_it_is_sent_stops_saying_what_is_indexed(
    fake_gateway: FakeGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documents are read again as they are sent: a line that is no longer what the
    check read (the file rewritten meanwhile) stops the command, naming the line, with what
    is known indexed and where to resume, as a refused request does."""
    text = "x" * 20_000  # lines past the reader's buffer: the lines after the first are read
    # after the first request; c0 again on line 5, so one request is in flight at a time
    rows = [{"id": f"c{i}", "text": text} for i in (0, 1, 2, 3, 0)]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    handle = fake_gateway.handle

    def rewrite_first(method: str, path: str, headers: dict[str, str], body: Any) -> Any:
        if method == "POST" and not fake_gateway.ingests:
            write_jsonl(corpus, [*rows[:3], {"id": "cX", "text": text}, rows[4]])  # line 4
        return handle(method, path, headers, body)

    monkeypatch.setattr(fake_gateway, "handle", rewrite_first)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", "--batch-size", "1")
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert f"{corpus}:4: changed since the file was checked (its id is now 'cX')" in output
    assert "3 of 5 document(s)" in output and "--from-line 4" in output, output


def test_ingest_of_a_line_blanked_while_it_is_sent_is_named(
    fake_gateway: FakeGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line made blank after the check (numbered lines skip it) is named as changed, not
    taken for the next document, nor read past to the file's end."""
    text = "x" * 20_000
    rows = [{"id": f"c{i}", "text": text} for i in (0, 1, 2, 3, 0)]  # as above
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    handle = fake_gateway.handle

    def rewrite_first(method: str, path: str, headers: dict[str, str], body: Any) -> Any:
        if method == "POST" and not fake_gateway.ingests:
            blank = " " * len(json.dumps(rows[2]))  # line 3 blank, the lines after in place
            write_jsonl(corpus, [*rows[:2], blank, *rows[3:]])
        return handle(method, path, headers, body)

    monkeypatch.setattr(fake_gateway, "handle", rewrite_first)
    result = run(fake_gateway, "ingest", str(corpus), "--index", "s", "--batch-size", "1")
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert f"{corpus}:3: changed since the file was checked (it is blank now)" in output, output
    assert "2 of 5 document(s)" in output and "--from-line 3" in output, output
