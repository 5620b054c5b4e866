"""Every paginated list the CLI reads (``Gateway.pages``) reads a page again through a
transient failure half-way: a lost connection, a 502/503/504, or a 429 after its
``Retry-After``. Before, only ``sift documents list`` and ``sift batch``'s result pages did:
``sift indexes``, ``sift searches|batches|ingestions`` and ``sift eval``'s result pages
stopped at the first such answer (exit 1), every page read before it lost."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from worker.cli import _eval_runs, _http, app, indexes, listing
from worker.cli._http import Gateway, GatewayError
from worker.cli.client import _batch


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


FAILURES: dict[str, Callable[[httpx.Request], httpx.Response]] = {
    "no connection": _refused,
    "502": lambda _: httpx.Response(502, text="bad gateway"),
    "503": lambda _: httpx.Response(
        503, json={"error": {"type": "unavailable", "message": "the job store is unavailable"}}
    ),
    "504": lambda _: httpx.Response(504, text="gateway timeout"),
    "429": lambda _: httpx.Response(
        429, headers={"retry-after": "7"}, json={"error": {"type": "rate_limited"}}
    ),
}


class Played:
    """A gateway whose list at any path has two pages of ``key`` (ids a, b then c), and
    that answers the second page's first request with ``failure``."""

    def __init__(self, key: str, failure: Callable[[httpx.Request], httpx.Response]) -> None:
        self.key = key
        self.failure = failure
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        self.asked.append(params.get("page_token", "first"))
        if "page_token" not in params:
            items = [{"id": "a", "status": "succeeded"}, {"id": "b", "status": "succeeded"}]
            return httpx.Response(200, json={self.key: items, "next_page_token": "t1"})
        if self.asked.count("t1") == 1:
            return self.failure(request)
        return httpx.Response(200, json={self.key: [{"id": "c", "status": "succeeded"}]})

    def gateway(self) -> Gateway:
        return Gateway("http://gw", "key", transport=httpx.MockTransport(self))


def _indexes(gw: Gateway, _: Path) -> list[str]:
    return [i["id"] for page in gw.pages("/v1/indexes", {}, "indexes") for i in page["indexes"]]


def _jobs(gw: Gateway, _: Path) -> list[str]:
    return [j["id"] for j in listing.fetch_jobs(gw, "/v1/batches", "batches", None, 10)[0]]


def _documents(gw: Gateway, _: Path) -> list[str]:
    return [d["id"] for d in indexes.fetch_documents(gw, "docs", None)[0]]


def _batch_results(gw: Gateway, tmp_path: Path) -> list[str]:
    out = tmp_path / "results.jsonl"
    _batch._write_results(gw, "bat_1", out, 500)
    return [json.loads(line)["id"] for line in out.read_text().splitlines()]


def _eval_results(gw: Gateway, _: Path) -> list[str]:
    return [r["id"] for r in _eval_runs._results(gw, "bat_1")]


READERS: dict[str, tuple[str, Callable[[Gateway, Path], list[str]]]] = {
    "sift indexes (Gateway.pages)": ("indexes", _indexes),
    "sift searches|batches|ingestions (fetch_jobs)": ("batches", _jobs),
    "sift documents list (document_pages)": ("documents", _documents),
    "sift batch's results": ("results", _batch_results),
    "sift eval's results": ("results", _eval_results),
}


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The retry waits, recorded instead of slept (tenacity sleeps by ``time.sleep``): this
    test's thread's only. A thread another test left running in this process (xdist runs
    many tests in one) sleeps for real, and is not counted: one had recorded 22,219 waits."""
    waits: list[float] = []
    real_sleep, ours = time.sleep, threading.current_thread()

    def sleep(seconds: float) -> None:
        if threading.current_thread() is ours:
            waits.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return waits


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("reader", list(READERS))
def test_each_list_reads_a_page_again_through_a_transient_failure(
    reader: str, failure: str, slept: list[float], tmp_path: Path
) -> None:
    key, read = READERS[reader]
    played = Played(key, FAILURES[failure])
    assert read(played.gateway(), tmp_path) == ["a", "b", "c"]
    assert played.asked == ["first", "t1", "t1"]
    assert len(slept) == 1
    if failure == "429":
        assert slept == [7.0]  # the Retry-After, not the backoff's first quarter second


def test_sift_indexes_lists_every_page_through_a_503_half_way(
    monkeypatch: pytest.MonkeyPatch, slept: list[float]
) -> None:
    """The command itself: the same table and exit 0 as with no 503."""

    def listed(failure: Callable[[httpx.Request], httpx.Response]) -> Any:
        def answer(request: httpx.Request) -> httpx.Response:
            response = played(request)
            if response.status_code == 200:
                body = response.json()
                body["indexes"] = [
                    {"name": i["id"], "documents": 1, "backend": "embedded"}
                    for i in body["indexes"]
                ]
                return httpx.Response(200, json=body)
            return response

        played = Played("indexes", failure)

        @contextlib.contextmanager
        def fake_gateway() -> Iterator[Gateway]:
            yield Gateway("http://gw", "key", transport=httpx.MockTransport(answer))

        monkeypatch.setattr(indexes, "gateway", fake_gateway)
        return CliRunner().invoke(app, ["indexes"], env={"COLUMNS": "200"})

    calm = listed(lambda _: httpx.Response(200, json={"indexes": [{"id": "c"}]}))
    through = listed(FAILURES["503"])
    assert through.exit_code == calm.exit_code == 0, through.output
    assert through.stdout == calm.stdout
    assert "3 index(es)" in through.stdout
    assert "trying again" in through.stderr


@pytest.mark.parametrize("failure", list(FAILURES))
def test_sift_eval_index_waits_for_its_batches_through_a_transient_failure(
    failure: str, monkeypatch: pytest.MonkeyPatch, slept: list[float]
) -> None:
    """``sift eval --index`` waits for its batches by reading each one's status, a GET like
    its result pages; one that met a 503 (or a lost connection, a 429) ended the evaluation
    (exit 1), its batches running on unread, while ``sift batch``'s wait reads through it."""
    statuses: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json={"id": "bat_1", "status": "queued"})
        if request.url.path == "/v1/batches/bat_1":
            statuses.append("asked")
            if len(statuses) == 1:
                return FAILURES[failure](request)
            return httpx.Response(200, json={"status": "succeeded", "counts": {"succeeded": 2}})
        results = [{"id": q, "query_id": q, "status": "succeeded"} for q in ("q1", "q2")]
        return httpx.Response(200, json={"results": results})

    @contextlib.contextmanager
    def fake_gateway() -> Iterator[Gateway]:
        yield Gateway("http://gw", "key", transport=httpx.MockTransport(answer))

    monkeypatch.setattr(_eval_runs, "gateway", fake_gateway)
    run = _eval_runs.RunSpec("bm25", "fts", False, 10)
    submitted, served = _eval_runs._run_batches("docs", [run], [("q1", "a"), ("q2", "b")], None)
    assert submitted == {"bm25": "bat_1"}
    assert [r["query_id"] for r in served["bm25"]] == ["q1", "q2"]
    assert statuses == ["asked", "asked"]


def test_a_gateway_never_reached_is_told_at_once_not_retried() -> None:
    """A refused connection before the gateway has ever answered this client means no gateway
    is running (a newcomer who has not run `sift up`): the command says so after one attempt
    rather than retrying for RETRY_SECONDS (two minutes) first. Once the gateway has answered,
    a refused connection is a restart, and is retried (the cases above)."""
    attempts: list[str] = []

    def refused(request: httpx.Request) -> httpx.Response:
        attempts.append(request.url.path)
        return _refused(request)

    gw = Gateway("http://gw", "key", transport=httpx.MockTransport(refused))
    with pytest.raises(GatewayError, match=r"cannot connect .* Start one with `sift up`"):
        next(gw.pages("/v1/indexes", {}, "indexes"))
    assert attempts == ["/v1/indexes"]


def test_a_removed_tenant_s_503_is_said_at_once_not_retried(slept: list[float]) -> None:
    """A worker answers an index read of a tenant removed from the keys ``503
    tenant_removed`` until the gateway restarts without its key: no retry passes it. The
    CLI read it as any 503 and retried for its two minutes before saying so."""
    asked: list[str] = []

    def removed(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        error = {"type": "tenant_removed", "message": "the index read failed: tenant removed"}
        return httpx.Response(503, json={"error": error})

    gw = Gateway("http://gw", "key", transport=httpx.MockTransport(removed))
    with pytest.raises(GatewayError, match="tenant removed") as caught:
        gw.json("GET", "/v1/indexes/docs", retry_for=120)
    assert not caught.value.transient
    assert asked == ["/v1/indexes/docs"] and slept == []


@pytest.mark.parametrize("offset", [-300, 300])
def test_a_retry_after_date_is_read_against_the_answer_s_own_date(offset: int) -> None:
    """A gateway (or the proxy before it) whose clock is 5 minutes off this machine's asks
    for 7 s as an HTTP-date on its clock, 7 s after its answer's ``Date``: the wait is 7 s.
    Before, the date was read against this machine's clock: none (the backoff's quarter
    second) 5 minutes behind, the 30 s cap (of 307 s) 5 minutes ahead."""
    answered = int(time.time()) + offset
    response = httpx.Response(
        429,
        headers={
            "date": formatdate(answered, usegmt=True),
            "retry-after": formatdate(answered + 7, usegmt=True),
        },
    )
    assert _http._retry_after(response) == 7.0
