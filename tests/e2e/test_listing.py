"""The job lists over HTTP and the CLI: ``GET /v1/searches``, ``/v1/batches``,
``/v1/ingestions`` and ``sift searches|batches|ingestions``, on the real stack.

Most of it runs on the idle gateway (no worker: its jobs stay ``queued`` unless canceled), so
statuses are deterministic; the e2e modules share the stack, so each test looks for its own
jobs at the top of the list (newest first) rather than at the whole list.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.conftest import ACME, INDEX, Stack
from worker.constants import (
    DEFAULT_PAGE_SIZE,
    JOB_INDEX_RETENTIONS,
    MAX_FILTER_KEYS,
    MAX_LIST_READ_BYTES,
    MAX_METADATA_VALUE_BYTES,
    RESULT_TTL_SECONDS,
    SEARCH_KEY,
)
from worker.queue.jobstore.jobindex import KIND_SEARCH, job_index_key

BATCH = {"index": INDEX, "queries": [{"id": "a", "query": "green tea"}]}


def _search(client: httpx.Client, query: str = "green tea", **params: Any) -> str:
    response = client.post(
        "/v1/searches", json={"index": INDEX, "query": query}, params=params, headers=ACME
    )
    assert response.status_code in (200, 202), response.text
    return str(response.json()["id"])


def _batch(client: httpx.Client) -> str:
    response = client.post("/v1/batches", json=BATCH, headers=ACME)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _pages(client: httpx.Client, path: str, key: str, **params: Any) -> list[list[dict[str, Any]]]:
    pages = []
    while True:
        response = client.get(path, params=params, headers=ACME)
        assert response.status_code == 200, response.text
        body = response.json()
        assert len(body[key]) <= params.get("page_size", 100)
        pages.append(body[key])
        if body["next_page_token"] is None:
            return pages
        params["page_token"] = body["next_page_token"]


def test_searches_are_listed_newest_first_a_page_at_a_time(stack: Stack) -> None:
    mine = [_search(stack.idle, f"list {i}") for i in range(5)]
    first = stack.idle.get("/v1/searches", params={"page_size": 2}, headers=ACME).json()
    assert [s["id"] for s in first["searches"]] == mine[:-3:-1]
    assert first["searches"][0] | {"created_at": "", "started_at": None} == {
        "id": mine[-1], "status": "queued", "index": INDEX, "query": "list 4",
        "mode": "hybrid", "created_at": "", "started_at": None, "finished_at": None,
        "error": None,
    }  # fmt: skip
    newer = _search(stack.idle, "created between two pages")
    rest = _pages(
        stack.idle, "/v1/searches", "searches", page_size=2, page_token=first["next_page_token"]
    )
    listed = [s["id"] for s in first["searches"]] + [s["id"] for page in rest for s in page]
    assert listed[:5] == mine[::-1]  # the one created meanwhile shifted nothing
    assert newer not in listed and len(listed) == len(set(listed))
    assert all(s["status"] == "queued" for page in rest for s in page)


def test_the_status_filter_and_each_kind(stack: Stack, corpus: object) -> None:
    done = _search(stack.live, "green tea", wait=20)
    waiting = _search(stack.idle)
    canceled, queued = _batch(stack.idle), _batch(stack.idle)
    assert stack.idle.delete(f"/v1/batches/{canceled}", headers=ACME).status_code == 200
    ingest = stack.idle.post(
        f"/v1/indexes/{INDEX}/documents",
        json={"documents": [{"id": "x", "text": "listed"}]},
        headers=ACME,
    ).json()["id"]

    def ids(client: httpx.Client, path: str, key: str, **params: Any) -> list[str]:
        return [job["id"] for page in _pages(client, path, key, **params) for job in page]

    succeeded = ids(stack.live, "/v1/searches", "searches", status="succeeded")
    assert done in succeeded and done not in ids(
        stack.live, "/v1/searches", "searches", status="queued"
    )
    assert ids(stack.idle, "/v1/searches", "searches", status="queued")[0] == waiting
    assert canceled in ids(stack.idle, "/v1/batches", "batches", status="canceled")
    queued_batches = ids(stack.idle, "/v1/batches", "batches", status="queued")
    assert queued_batches[0] == queued and canceled not in queued_batches
    top = stack.idle.get("/v1/batches", params={"page_size": 2}, headers=ACME).json()["batches"]
    assert [(b["id"], b["status"], b["counts"]["total"]) for b in top] == [
        (queued, "queued", 1), (canceled, "canceled", 1),
    ]  # fmt: skip
    ingestions = stack.idle.get("/v1/ingestions", params={"page_size": 1}, headers=ACME).json()
    assert [(i["id"], i["status"], i["documents"]) for i in ingestions["ingestions"]] == [
        (ingest, "queued", 1)
    ]


def test_a_job_whose_record_expired_is_not_listed(stack: Stack) -> None:
    old, kept = _search(stack.idle, "expires"), _search(stack.idle, "stays")
    client = redis.Redis.from_url(stack.redis_url + "/1", decode_responses=True)
    try:
        index = job_index_key(KIND_SEARCH, "acme")
        assert 0 < client.ttl(index) <= RESULT_TTL_SECONDS * JOB_INDEX_RETENTIONS
        assert client.ttl(SEARCH_KEY + old) == -1  # queued: kept until its end
        client.pexpire(SEARCH_KEY + old, 1)  # its retention ends (as once it has ended)
        time.sleep(0.01)
        assert client.exists(SEARCH_KEY + old) == 0
        listed = stack.idle.get("/v1/searches", params={"page_size": 3}, headers=ACME).json()
        assert listed["searches"][0]["id"] == kept
        assert old not in [s["id"] for s in listed["searches"]]
        assert client.zscore(index, old) is None and client.zscore(index, kept) is not None
    finally:
        client.close()


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize("path", ["/v1/searches", "/v1/batches", "/v1/ingestions"])
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": 1001}, "page_size"),
        ({"page_size": "ten"}, "page_size"),
        ({"page_token": ""}, "page_token"),
        ({"page_token": "not-a-token"}, "page_token"),
        ({"page_token": _token("o:5")}, "page_token"),  # an index-list token
        ({"page_token": _token("r:" + "0" * 16 + ":5")}, "page_token"),  # a batch-results one
        ({"page_token": _token("c:1.5:srch_" + "0" * 31)}, "page_token"),
        ({"page_token": _token("c:1e9:bat_" + "0" * 32)}, "page_token"),
        ({"page_token": "x" * 200}, "page_token"),
        ({"status": "done"}, "status"),
        ({"status": ""}, "status"),
    ],
)
def test_bad_list_parameters_are_422_naming_the_field(
    stack: Stack, path: str, params: dict[str, Any], field: str
) -> None:
    response = stack.idle.get(path, params=params, headers=ACME)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_a_token_of_one_list_is_refused_by_another(stack: Stack) -> None:
    _search(stack.idle), _search(stack.idle)
    token = stack.idle.get("/v1/searches", params={"page_size": 1}, headers=ACME).json()[
        "next_page_token"
    ]
    assert token is not None
    response = stack.idle.get("/v1/batches", params={"page_token": token}, headers=ACME)
    assert response.status_code == 422 and response.json()["error"]["field"] == "page_token"


def test_the_lists_need_a_key_and_are_documented(stack: Stack) -> None:
    assert stack.idle.get("/v1/batches").status_code == 401
    document = stack.idle.get("/openapi.json").json()
    for path, key in (("/v1/searches", "searches"), ("/v1/batches", "batches"),
                      ("/v1/ingestions", "ingestions")):  # fmt: skip
        get = document["paths"][path]["get"]
        assert {p["name"] for p in get["parameters"]} >= {"status", "page_size", "page_token"}
        assert "422" in get["responses"] and "Newest first" in get["description"]
        schema = get["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert key in document["components"]["schemas"][schema.rsplit("/", 1)[1]]["properties"]


def _sift(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SIFT_URL": stack.idle_url, "SIFT_API_KEY": "acme-key-0001",
           "COLUMNS": "250"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_cli_lists_jobs(stack: Stack) -> None:
    canceled, queued = _batch(stack.idle), _batch(stack.idle)
    stack.idle.delete(f"/v1/batches/{canceled}", headers=ACME)
    search = _search(stack.idle, "seen by the cli")
    run = _sift(stack, "batches", "--status", "canceled", "--json", "--limit", "5")
    assert run.returncode == 0, run.stderr
    listed = json.loads(run.stdout)
    assert listed[0]["id"] == canceled and {b["status"] for b in listed} == {"canceled"}
    run = _sift(stack, "batches", "--limit", "2")
    assert run.returncode == 0 and queued in run.stdout and canceled in run.stdout
    run = _sift(stack, "searches", "--limit", "1")
    assert run.returncode == 0 and search in run.stdout and "seen by the cli" in run.stdout
    # more jobs than shown: a line says so, as `sift documents list`'s does (none did)
    _search(stack.idle, "one more")
    run = _sift(stack, "searches", "--limit", "1")
    assert "more searches follow: --limit N shows more" in " ".join(run.stdout.split())
    run = _sift(stack, "batches", "--limit", "1")
    assert "more batches follow: --limit N shows more" in " ".join(run.stdout.split())
    run = _sift(stack, "batches", "--limit", "1000")  # every one of them shown
    assert run.returncode == 0 and "follow" not in run.stdout, run.stdout
    run = _sift(stack, "ingestions", "--json", "--limit", "1001")  # two pages' worth asked
    assert run.returncode == 0 and isinstance(json.loads(run.stdout), list)
    run = _sift(stack, "searches", "--status", "done")
    assert run.returncode == 2 and "--status" in run.stderr and "Traceback" not in run.stderr


def test_a_search_list_page_ends_at_the_byte_budget_and_goes_on_from_there(
    stack: Stack, corpus: object
) -> None:
    """A search's entry is small, but its record's spec is read to make it, and a spec holds
    its filters: up to 100 of 8 kB each (~830 kB). A page of 1,000 of them was read whole."""
    filters = {
        f"k{j:03d}": f"{j}".ljust(MAX_METADATA_VALUE_BYTES, "v") for j in range(MAX_FILTER_KEYS)
    }
    spec_bytes = len(json.dumps(filters, separators=(",", ":")))
    count = MAX_LIST_READ_BYTES // spec_bytes + 3  # past one page's budget
    mine, statuses = [], set()
    for i in range(count):
        response = stack.live.post(
            "/v1/searches",
            json={"index": INDEX, "query": f"green tea {i}", "filters": filters},
            params={"wait": 20},
            headers=ACME,
        )
        assert response.status_code == 200, response.text
        mine.append(response.json()["id"])
        statuses.add(response.json()["status"])
    (status,) = statuses
    for params in ({}, {"status": status}):  # a filtered read is bounded too
        pages = _pages(stack.live, "/v1/searches", "searches", **params)
        listed = [s["id"] for page in pages for s in page]
        assert len(listed) == len(set(listed))  # none twice
        assert listed[:count] == mine[::-1]  # newest first, none skipped
        ours = [[s["id"] for s in page if s["id"] in mine] for page in pages]
        # each page ended at the budget: more than one such search, never all of them
        assert all(len(page) <= MAX_LIST_READ_BYTES // spec_bytes for page in ours), ours
        assert len(ours[0]) > 1 and len(pages[0]) < DEFAULT_PAGE_SIZE, ours
