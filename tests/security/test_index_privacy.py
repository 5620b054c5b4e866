"""Index names are private to a tenant (issue 12, item 6), over the real stack.

Acme ingests the index ``secret``; globex then asks for ``secret`` and for ``nothing-here``, a
name nobody has, on every route that takes an index name: a search (waited for and polled,
each mode, rerank on and off, trace on), a batch (both lanes), the job reads, and the
webhooks. Each pair of answers must be the same once the index name (the caller's own
input), the job ids and the timestamps are set aside: the same HTTP status, job status,
error type, message and ``retryable``, the same batch counts and result pages, the same
webhook payloads. Acme searching ``secret`` is the control: the name does exist.

The stack is the security suite's (real redis-server, a Celery worker, the gateway under
uvicorn, the embedded backend, the fake Messages API), at its defaults.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import ACME, GLOBEX, Stack
from tests.services import webhook_inbox

SECRET = "secret"
NOBODY = "nothing-here"
VOLATILE = {"id", "created_at", "started_at", "finished_at", "canceled_at", "timestamp"}
NOT_FOUND = {
    "type": "index_not_found",
    "message": "index 'NAME' does not exist: ingest documents into it first",
    "retryable": False,
    "usage": None,  # no model call was made
}
Inbox = tuple[str, "queue.Queue[tuple[bytes, dict[str, str]]]"]


def same_shape(value: Any, name: str) -> Any:
    """``value`` with ``name`` written ``NAME`` and the ids and timestamps left out."""
    if isinstance(value, dict):
        return {k: same_shape(v, name) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [same_shape(v, name) for v in value]
    if isinstance(value, str):
        return value.replace(name, "NAME")
    return value


@pytest.fixture(scope="module")
def secret(stack: Stack) -> str:
    """Acme's index ``secret``, with vectors (every mode can search it)."""
    documents = [
        {
            "id": "s1",
            "title": "Launch plan",
            "text": "The launch moves to March, codename heron.",
            "metadata": {"lang": "en"},
        },
        {"id": "s2", "title": "Budget", "text": "Marketing budget for the heron launch."},
    ]
    response = stack.live.post(
        f"/v1/indexes/{SECRET}/documents",
        params={"wait": 20},
        json={"documents": documents},
        headers=ACME,
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    return SECRET


@pytest.fixture(scope="module")
def inbox() -> Iterator[Inbox]:
    with webhook_inbox() as receiver:
        yield receiver


def search(stack: Stack, index: str, headers: dict[str, str], **extra: Any) -> Any:
    body = {"index": index, "query": "heron launch", **extra}
    return stack.live.post("/v1/searches", params={"wait": 20}, json=body, headers=headers)


def settled(stack: Stack, path: str, headers: dict[str, str]) -> dict[str, Any]:
    """``GET path`` once the job is final (a 30 s bound; the stack answers in well under 1 s)."""
    deadline = time.monotonic() + 30
    while True:
        body: dict[str, Any] = stack.live.get(path, headers=headers).json()
        if body["status"] in ("succeeded", "failed", "canceled"):
            return body
        assert time.monotonic() < deadline, f"{path} still {body['status']}"
        time.sleep(0.05)


SEARCHES: list[dict[str, Any]] = [
    {},
    {"mode": "fts"},
    {"mode": "vector"},
    {"mode": "hybrid", "rerank": True, "include_trace": True},
    {"mode": "fts", "rerank": False, "filters": {"lang": "en"}, "limit": 3},
]


@pytest.mark.parametrize("extra", SEARCHES, ids=lambda e: json.dumps(e, sort_keys=True))
def test_a_search_of_another_tenants_index_reads_like_one_of_no_index(
    stack: Stack, secret: str, extra: dict[str, Any]
) -> None:
    own = search(stack, secret, ACME, **extra)
    assert own.status_code == 200 and own.json()["status"] == "succeeded", own.text
    assert own.json()["result"]["hits"], "the control: acme's index answers"

    theirs, nobodys = search(stack, secret, GLOBEX, **extra), search(stack, NOBODY, GLOBEX, **extra)
    assert theirs.status_code == nobodys.status_code == 200
    assert theirs.json()["status"] == "failed", theirs.text
    assert same_shape(theirs.json()["error"], secret) == NOT_FOUND
    assert same_shape(theirs.json(), secret) == same_shape(nobodys.json(), NOBODY)
    assert set(theirs.headers) == set(nobodys.headers)
    # the job read later, and the job polled to its end without waiting, say the same
    for first, name in ((theirs, secret), (nobodys, NOBODY)):
        again = stack.live.get(f"/v1/searches/{first.json()['id']}", headers=GLOBEX)
        assert again.status_code == 200
        assert same_shape(again.json(), name) == same_shape(first.json(), name)
    polled = []
    for name in (secret, NOBODY):
        queued = stack.live.post(
            "/v1/searches", json={"index": name, "query": "heron", **extra}, headers=GLOBEX
        )
        assert queued.status_code == 202, queued.text
        polled.append(
            same_shape(settled(stack, f"/v1/searches/{queued.json()['id']}", GLOBEX), name)
        )
    assert polled[0] == polled[1] and polled[0]["error"] == NOT_FOUND


@pytest.mark.parametrize("lane", ["standard", "economy"])
def test_a_batch_on_another_tenants_index_reads_like_one_on_no_index(
    stack: Stack, secret: str, lane: str
) -> None:
    queries = [
        {"id": "q0", "query": "heron launch"},
        {"id": "q1", "query": "budget", "mode": "fts"},
        {"id": "q2", "query": "march", "mode": "vector", "limit": 2},
    ]
    seen: list[tuple[Any, Any]] = []
    for name in (secret, NOBODY):
        created = stack.live.post(
            "/v1/batches",
            json={"index": name, "queries": queries, "rerank": True, "lane": lane},
            headers=GLOBEX,
        )
        assert created.status_code == 202, created.text
        batch_id = created.json()["id"]
        final = settled(stack, f"/v1/batches/{batch_id}", GLOBEX)
        page = stack.live.get(f"/v1/batches/{batch_id}/results", headers=GLOBEX)
        assert page.status_code == 200
        seen.append((same_shape(final, name), same_shape(page.json(), name)))
    (their_batch, their_page), (nobodys_batch, nobodys_page) = seen
    assert their_batch == nobodys_batch
    assert their_batch["counts"]["failed"] == len(queries)
    assert their_page == nobodys_page
    assert [item["error"] for item in their_page["results"]] == [NOT_FOUND] * len(queries)


def test_webhooks_for_another_tenants_index_read_like_those_for_no_index(
    stack: Stack, secret: str, inbox: Inbox
) -> None:
    url, received = inbox
    sent: dict[str, str] = {}  # job id -> the index name it asked for
    for name in (secret, NOBODY):
        found = search(stack, name, GLOBEX, webhook_url=url)
        batch = stack.live.post(
            "/v1/batches",
            json={"index": name, "queries": [{"id": "q", "query": "heron"}], "webhook_url": url},
            headers=GLOBEX,
        )
        sent[found.json()["id"]] = sent[batch.json()["id"]] = name
    events: dict[str, list[dict[str, Any]]] = {secret: [], NOBODY: []}
    while sum(len(v) for v in events.values()) < len(sent):
        body, _ = received.get(timeout=30)
        event = json.loads(body)
        name = sent.get(event["data"]["id"])
        if name is not None:
            events[name].append(same_shape(event, name))

    def order(e: dict[str, Any]) -> str:
        return json.dumps(e, sort_keys=True)

    assert sorted(events[secret], key=order) == sorted(events[NOBODY], key=order)
    assert {e["type"] for e in events[secret]} == {"search.completed", "batch.completed"}


def test_once_globex_writes_to_the_name_it_is_globex_s_own_index(stack: Stack, secret: str) -> None:
    """Ingest into the name is allowed: it makes the tenant's own index, holding only its own."""
    name = f"{secret}-shared"
    for headers, doc in ((ACME, "acme-doc"), (GLOBEX, "globex-doc")):
        written = stack.live.post(
            f"/v1/indexes/{name}/documents",
            params={"wait": 20},
            json={"documents": [{"id": doc, "text": "heron launch notes"}]},
            headers=headers,
        )
        assert written.status_code == 200 and written.json()["status"] == "succeeded"
    found = search(stack, name, GLOBEX)
    assert found.json()["status"] == "succeeded", found.text
    assert [hit["id"] for hit in found.json()["result"]["hits"]] == ["globex-doc"]
