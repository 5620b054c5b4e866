"""``bench_batch_100k --corpus``: an ingest the gateway has not finished within ``?wait`` is
polled until final, and the benchmark goes on once it succeeded.

The ingest of a 1,000-document request takes longer than the API's longest wait (30 s)
on a loaded machine: the gateway answers ``202`` with the job still running, the benchmark
polls its ``Location``, and the job succeeds. A leftover check of the *first* answer's
status (``queued``) then failed the benchmark anyway, before its batch.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from benchmarks import bench_batch_100k

JOB = "ing_" + "1" * 32


def answers(sent: list[str], final: str) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        if request.method == "POST":  # not finished within ?wait: 202, poll the Location
            headers = {"location": f"/v1/ingestions/{JOB}"}
            return httpx.Response(202, json={"id": JOB, "status": "queued"}, headers=headers)
        return httpx.Response(200, json={"id": JOB, "status": final, "error": None})

    return httpx.MockTransport(answer)


def documents(n: int) -> list[dict[str, Any]]:
    return [{"id": f"d{i}", "text": "tea"} for i in range(n)]


def test_an_ingest_finished_after_the_wait_is_polled_and_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_batch_100k.time, "sleep", lambda _: None)
    sent: list[str] = []
    with httpx.Client(base_url="http://gw", transport=answers(sent, "succeeded")) as client:
        bench_batch_100k.ingest_corpus(client, documents(3), sample=False)
    assert sent == [
        f"POST /v1/indexes/{bench_batch_100k.INDEX}/documents",
        f"GET /v1/ingestions/{JOB}",
    ]


def test_an_ingest_that_failed_stops_the_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_batch_100k.time, "sleep", lambda _: None)
    with (
        httpx.Client(base_url="http://gw", transport=answers([], "failed")) as client,
        pytest.raises(SystemExit, match=f"ingest {JOB} failed"),
    ):
        bench_batch_100k.ingest_corpus(client, documents(3), sample=False)
