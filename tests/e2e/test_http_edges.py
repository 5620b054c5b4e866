"""The HTTP edges a careful client meets, over real HTTP against the e2e stack: a last line
break on the framework's own routes, ``HEAD`` on every ``GET`` route, an
``Idempotency-Key`` sent where it is not honoured, and a body with a problem in every item."""

from __future__ import annotations

import http.client
import re
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from tests.e2e.conftest import ACME, GLOBEX, INDEX, Stack
from worker.constants import BATCH_KEY, INGEST_KEY, SEARCH_KEY

SEARCH = {"index": INDEX, "query": "tea"}


@pytest.mark.parametrize(
    "path",
    [
        "/openapi.json%0A",
        "/docs%0A",
        "/docs/oauth2-redirect%0A",
        "/docs/assets/swagger-ui.css%0A",
        "/metrics%0A",
        "/readyz%0A",
    ],
)
def test_a_last_line_break_is_404_on_the_framework_s_routes_too(stack: Stack, path: str) -> None:
    """FastAPI's ``/openapi.json`` (a Starlette route of its own, which the app's dependencies
    never ran on) and the ``/docs`` assets (a mount) were served with a last line break, while
    every other route answered it ``404``: each path's end is now its end, on every route."""
    response = stack.live.get(path, headers=ACME)
    assert response.status_code == 404, (response.status_code, response.text[:200])
    error = response.json()["error"]
    assert error["field"] == "path" and repr(path.replace("%0A", "\n")) in error["message"]


def _jobs(stack: Stack, corpus: list[dict[str, Any]]) -> dict[str, str]:
    """One finished job of each kind for acme on the live stack, and a document id."""
    search = stack.live.post("/v1/searches", params={"wait": 20}, json=SEARCH, headers=ACME)
    batch = stack.live.post(
        "/v1/batches",
        json={"index": INDEX, "queries": [{"id": "a", "query": "tea"}]},
        headers=ACME,
    )
    ingest = stack.live.post(
        "/v1/indexes/head-check/documents",
        params={"wait": 20},
        json={"documents": [{"id": "h1", "text": "okapi"}]},
        headers=ACME,
    )
    assert search.status_code == 200 and ingest.status_code == 200, (search.text, ingest.text)
    assert batch.status_code == 202, batch.text
    return {
        "job_id": search.json()["id"],
        "batch_id": batch.json()["id"],
        "ingest_id": ingest.json()["id"],
        "doc_id": str(corpus[0]["id"]),
    }


GET_PATHS = [
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/docs/assets/swagger-ui.css",
    "/v1/searches",
    "/v1/searches/{job_id}",
    "/v1/batches",
    "/v1/batches/{batch_id}",
    "/v1/batches/{batch_id}/results",
    "/v1/ingestions",
    "/v1/ingestions/{ingest_id}",
    "/v1/indexes",
    f"/v1/indexes/{INDEX}",
    f"/v1/indexes/{INDEX}/documents",
    f"/v1/indexes/{INDEX}/documents/{{doc_id}}",
    f"/v1/indexes/{INDEX}/documents/delete",  # document "delete": the GET, never the bulk POST
    "/v1/searches/srch_nope",  # a 404 answers HEAD with the 404's headers
]


def _raw_head(url: str, path: str, headers: dict[str, str]) -> bytes:
    """What the server sends to a ``HEAD`` on a connection it then closes: an HTTP client
    reads no body after a HEAD's headers whatever was sent, so this reads the bytes."""
    parts = urlsplit(url)
    lines = [f"HEAD {path} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_every_get_route_answers_head_with_its_headers_and_no_body(
    stack: Stack, corpus: list[dict[str, Any]]
) -> None:
    """RFC 9110 (9.3.2): a resource that answers ``GET`` answers ``HEAD`` with the same
    status and headers and no content. Only the probes did; every other ``GET`` route was
    ``405`` (FastAPI's routes take the methods they are declared with, alone)."""
    ids = _jobs(stack, corpus)
    declared = {
        re.sub(r"\{[^}]+\}", "{}", path)
        for path, operations in stack.live.get("/openapi.json").json()["paths"].items()
        if "get" in operations
    }
    covered = {re.sub(r"\{[^}]+\}", "{}", p.replace(f"/{INDEX}", "/{index}")) for p in GET_PATHS}
    assert declared <= covered, declared - covered  # a new GET route is checked here too
    volatile = {"date", "content-length"} | {"etag", "last-modified"}
    for template in GET_PATHS:
        path = template.format(**ids)
        got = stack.live.get(path, headers=ACME)
        head = stack.live.head(path, headers=ACME)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        same = {k: v for k, v in got.headers.items() if k not in volatile}
        assert {k: v for k, v in head.headers.items() if k not in volatile} == same, path
        if path not in ("/metrics",):  # its counters move between the two requests
            assert head.headers.get("content-length") == got.headers.get("content-length")
        raw = _raw_head(stack.live_url, path, ACME)
        assert raw.endswith(b"\r\n\r\n") and raw.count(b"\r\n\r\n") == 1, (path, raw[-200:])
    # counted under HEAD and the route's OpenAPI path, as a GET is under GET
    label = 'method="HEAD",route="/v1/indexes/{index}/documents/{id}",status="200"'
    assert label in stack.live.get("/metrics").text


def _state(stack: Stack) -> tuple[Any, ...]:
    """What a request could change for acme: its jobs of each kind, the index's documents,
    and the model's calls."""
    jobs = tuple(
        tuple(j["id"] for j in stack.live.get(f"/v1/{kind}", headers=ACME).json()[kind])
        for kind in ("searches", "batches", "ingestions")
    )
    index = stack.live.get(f"/v1/indexes/{INDEX}", headers=ACME).json()
    return jobs, index["documents"], len(stack.model.requests())


def test_head_changes_nothing(stack: Stack, corpus: list[dict[str, Any]]) -> None:
    """A ``HEAD`` does what its ``GET`` does, a read: no job made, no document deleted (``HEAD
    .../documents/delete`` is document "delete"'s read, never the bulk delete's ``POST``), no
    model call. (It passed before too, with every ``HEAD`` a ``405``: a guard on the routing.)"""
    ids = _jobs(stack, corpus)
    before = _state(stack)
    for template in GET_PATHS:
        stack.live.head(template.format(**ids), headers=ACME)
    assert _state(stack) == before


def test_head_keeps_the_get_s_key_and_tenant_rules(stack: Stack, corpus: object) -> None:
    job = stack.live.post("/v1/searches", json=SEARCH, headers=ACME).json()["id"]
    for path in (f"/v1/searches/{job}", f"/v1/indexes/{INDEX}/documents"):
        unauthenticated = stack.live.head(path)
        assert unauthenticated.status_code == 401, path
        assert unauthenticated.headers["www-authenticate"] == "Bearer"
    assert stack.live.head(f"/v1/searches/{job}", headers=GLOBEX).status_code == 404
    assert stack.live.head(f"/v1/searches/{job}", headers=ACME).status_code == 200
    typo = stack.live.head("/v1/searches", params={"statu": "failed"}, headers=ACME)
    assert typo.status_code == 422, typo.headers  # the GET's parameter check


@pytest.mark.parametrize(
    ("path", "allow"),
    [
        ("/v1/batches/bat_0", "DELETE, GET, HEAD"),
        (f"/v1/indexes/{INDEX}", "DELETE, GET, HEAD, PATCH"),
        ("/v1/searches", "GET, HEAD, POST"),
        ("/metrics", "GET, HEAD"),
    ],
)
def test_a_405_allows_head_where_get_is(stack: Stack, path: str, allow: str) -> None:
    response = stack.live.request("PUT", path, headers=ACME)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allow


def test_openapi_lists_the_gets_not_a_head_for_each(stack: Stack) -> None:
    """``HEAD`` is HTTP's, implied by each ``GET``: the document lists no ``head`` operation
    (one per route doubled it, each with the GET's operation id)."""
    paths = stack.live.get("/openapi.json").json()["paths"]
    assert not [p for p, operations in paths.items() if "head" in operations]
    assert "get" in paths["/healthz"] and "get" in paths["/v1/searches/{id}"]


KEYED = {"Idempotency-Key": "k-" + "1" * 20, **ACME}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PATCH", "/v1/indexes/idem-3", {"candidate_limit": 20}),
    ],
)
def test_an_idempotency_key_where_it_is_not_honoured_is_422_naming_it(
    stack: Stack, method: str, path: str, body: dict[str, Any]
) -> None:
    """Only ``POST /v1/searches``, ``POST /v1/batches`` and the writes (an ingest, the
    deletes) honour ``Idempotency-Key``; elsewhere it was silently ignored, so a client that
    sent it believed a resend gave the same job and got a second. Now a ``POST`` or ``PATCH``
    that does not take it is refused before anything is done, naming the header and the
    routes that take it."""
    response = stack.live.request(method, path, json=body, headers=KEYED)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "Idempotency-Key", error
    assert "POST /v1/searches" in error["message"] and "POST /v1/batches" in error["message"]
    index = path.split("/")[3]
    assert stack.live.get(f"/v1/indexes/{index}", headers=ACME).status_code == 404
    listed = stack.live.get("/v1/ingestions", headers=ACME).json()["ingestions"]
    assert all(job["index"] != index for job in listed), listed
    assert stack.live.request(method, path, json=body, headers={}).status_code == 401


def test_an_ingest_sent_again_with_its_idempotency_key_answers_its_first_job(
    stack: Stack,
) -> None:
    """An ingest made again would take a newer write version than a delete of its ids
    accepted in between, and bring them back: the same key and body give the first job
    (``Idempotent-Replayed``), another body or another index's route is ``422``."""
    headers = {**ACME, "Idempotency-Key": "ingest-replay-1"}
    path, body = "/v1/indexes/idem-ingest/documents", {"documents": [{"id": "d", "text": "t"}]}
    first = stack.live.post(path, json=body, headers=headers, params={"wait": 30})
    assert first.status_code == 200, first.text
    again = stack.live.post(path, json=body, headers=headers)
    assert again.status_code == 200, again.text  # final: 200, as a finished search's replay
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    listed = stack.live.get("/v1/ingestions", headers=ACME).json()["ingestions"]
    assert [job["id"] for job in listed if job["index"] == "idem-ingest"] == [first.json()["id"]]
    for other_path, other_body in [
        (path, {"documents": [{"id": "d", "text": "another"}]}),
        ("/v1/indexes/idem-ingest-2/documents", body),
    ]:
        refused = stack.live.post(other_path, json=other_body, headers=headers)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["field"] == "Idempotency-Key", refused.text
    assert stack.live.get("/v1/indexes/idem-ingest-2", headers=ACME).status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "body", "record"),
    [
        ("POST", "/v1/indexes/idem-lost/documents", {"documents": [{"id": "d", "text": "t"}]},
         INGEST_KEY),
        ("POST", "/v1/searches", SEARCH, SEARCH_KEY),
        ("POST", "/v1/batches", {"index": INDEX, "queries": [{"id": "q", "query": "tea"}]},
         BATCH_KEY),
        ("DELETE", "/v1/indexes/idem-lost/documents/d", None, INGEST_KEY),
        ("POST", "/v1/indexes/idem-lost/documents/delete", {"ids": ["d", "e"]}, INGEST_KEY),
        ("DELETE", "/v1/indexes/idem-lost-drop", None, INGEST_KEY),
    ],
    ids=["ingest", "search", "batch", "delete", "bulk-delete", "drop-index"],
)  # fmt: skip
def test_a_key_whose_job_the_job_store_lost_is_410_naming_it_and_a_new_key_makes_the_job(
    stack: Stack, corpus: object, method: str, path: str, body: dict[str, Any] | None,
    record: str,
) -> None:  # fmt: skip
    """A key bound to a job whose record the job store no longer holds (a Redis restored
    without it, a purge under way) replays nothing: each resend is ``410``
    ``idempotency_key_job_gone`` naming the key, for the key's 24 hours, and a request with a
    new key makes the job again. An ingest's resend was a ``503`` saying to send the request
    again, which replayed the same missing job until the key expired; a search's or a
    batch's a ``404`` naming ``id``, which the request has none of. The deletes (of a
    document, of documents by id, of an index) are write jobs replayed by their key as an
    ingest is, and answer the same."""
    keyed = {**ACME, "Idempotency-Key": f"lost-{method}-{path}"}
    wait = {} if path == "/v1/batches" else {"wait": 20}  # a batch takes no wait
    first = stack.live.request(method, path, json=body, headers=keyed, params=wait)
    assert first.status_code in (200, 202), first.text
    job_id = first.json()["id"]
    with redis.Redis.from_url(stack.redis_url + "/0") as store:
        wait_until_final = time.monotonic() + 30
        while store.hget(record + job_id, "finished_at") is None:  # let its worker finish it
            assert time.monotonic() < wait_until_final, job_id
            time.sleep(0.05)
        assert store.delete(record + job_id) == 1  # lost: its key is still bound to it
    for _ in range(2):  # the same answer every time: sending it again cannot help
        again = stack.live.request(method, path, json=body, headers=keyed)
        assert again.status_code == 410, again.text
        error = again.json()["error"]
        assert error["type"] == "idempotency_key_job_gone", error
        assert error["field"] == "Idempotency-Key", error
        assert job_id in error["message"] and "new Idempotency-Key" in error["message"], error
        assert "retry-after" not in again.headers, again.headers
    made = stack.live.request(
        method, path, json=body, headers={**keyed, "Idempotency-Key": f"lost-new-{method}-{path}"}
    )
    assert made.status_code in (200, 202), made.text
    assert made.json()["id"] != job_id


def test_an_idempotency_key_on_a_read_changes_nothing_and_replays_a_delete(
    stack: Stack, corpus: object
) -> None:
    """``GET`` and ``HEAD`` read: a key there has nothing to add, and is accepted as it was.
    A ``DELETE`` is a write job: sent again with its key it answers its first job (a second
    job, newer than an ingest of the id accepted in between, deleted what that wrote); the
    key on another document's path is ``422``, whose message says a path may be what differs
    (a ``DELETE`` has no body: a message naming only the body sends a client looking for one)."""
    assert stack.live.get(f"/v1/indexes/{INDEX}", headers=KEYED).status_code == 200
    assert stack.live.head(f"/v1/indexes/{INDEX}", headers=KEYED).status_code == 200
    keyed = {**ACME, "Idempotency-Key": "delete-nobody-1"}
    gone = stack.live.delete(f"/v1/indexes/{INDEX}/documents/nobody", headers=keyed)
    assert gone.status_code == 202, gone.text
    again = stack.live.delete(f"/v1/indexes/{INDEX}/documents/nobody", headers=keyed)
    assert again.status_code in (200, 202), again.text
    assert again.json()["id"] == gone.json()["id"], again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    other = stack.live.delete(f"/v1/indexes/{INDEX}/documents/nobody-2", headers=keyed)
    assert other.status_code == 422, other.text
    assert other.json()["error"]["field"] == "Idempotency-Key", other.text
    assert other.json()["error"]["message"] == (
        "Idempotency-Key: already used with a different request (another path or body)"
    ), other.text


def test_an_encoded_slash_is_no_segment_boundary_on_the_job_routes(
    stack: Stack, corpus: list[dict[str, Any]]
) -> None:
    """The server decodes ``%2F`` before routing: ``POST /v1%2Fsearches`` ran a search and
    ``GET /v1/batches/{id}%2Fresults`` gave the batch's results. A path is routed on its
    segments: the first is no route's, the second is the batch id ``{id}/results``, which no
    batch has."""
    ids = _jobs(stack, corpus)
    searched = stack.live.post("/v1%2Fsearches", json=SEARCH, headers=ACME)
    assert searched.status_code == 404 and searched.json()["error"]["field"] == "path"
    results = stack.live.get(f"/v1/batches/{ids['batch_id']}%2Fresults", headers=ACME)
    assert results.status_code == 404 and results.json()["error"]["field"] == "id", results.text
    assert stack.live.get(f"/v1/batches/{ids['batch_id']}/results", headers=ACME).is_success


def test_the_gateway_keeps_an_idle_connection_longer_than_a_pooling_client_does(
    stack: Stack,
) -> None:
    """httpx, under the Python SDKs and ``sift``'s own client, reuses a connection idle for up
    to 5 s; uvicorn closed one idle for 5 s, so a request sent as the gateway closed it got
    no answer ("Server disconnected without sending a response", seen in a CI run on a
    loaded machine, on a plain ``GET``). The gateway keeps an idle connection 75 s."""
    parts = urlsplit(stack.idle_url)
    assert parts.hostname and parts.port
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", "/healthz")
        assert connection.getresponse().read()
        opened = connection.sock
        time.sleep(httpx.Limits().keepalive_expiry + 1)  # longer than httpx keeps one idle
        connection.request("GET", "/healthz")
        again = connection.getresponse()
        assert again.status == 200 and connection.sock is opened
    finally:
        connection.close()


LISTED = 100  # the most problems a 400 or 422 lists (api_gateway.errors.MAX_LISTED_PROBLEMS)


@pytest.mark.parametrize("route", ["batch", "ingest"])
def test_a_body_with_a_problem_in_every_item_lists_the_first_ones(stack: Stack, route: str) -> None:
    """A 422 lists the first problems of a body, and says more follow: it listed every one,
    so a batch of 100,000 queries each with ``"limit": "10"`` (a string) was answered with
    all 100,000 (46 MB for an 8 MB body with three problems in each query), an answer the
    gateway built on its event loop, its ``/healthz`` unanswered meanwhile (2.6 s, seen by
    use on a stack at the defaults). Nothing is stored."""
    index = f"many-problems-{route}"
    if route == "batch":
        path = "/v1/batches"
        queries = [{"id": f"q{i}", "query": "tea", "limit": "10"} for i in range(100_000)]
        body: dict[str, Any] = {"index": index, "queries": queries}
        named = [f"queries[{i}].limit" for i in range(LISTED)]
    else:
        path = f"/v1/indexes/{index}/documents"
        metadata = {f"k{j}": None for j in range(100)}  # null: not a value metadata takes
        documents = [{"id": f"d{i}", "text": "tea", "metadata": metadata} for i in range(1_000)]
        body = {"documents": documents}
        named = [f"documents[0].metadata.k{j}" for j in range(LISTED)]
    answer = stack.live.post(path, json=body, headers=ACME, timeout=120)
    assert answer.status_code == 422, answer.text[:500]
    error = answer.json()["error"]
    assert error["field"] == named[0]
    assert [problem["field"] for problem in error["fields"]] == named
    assert error["message"].startswith(f"{named[0]}: ")
    assert f"; {named[-1]}: " in error["message"]
    assert error["message"].endswith(f"more problems follow, not listed (the first {LISTED} are)")
    assert len(answer.content) < 50_000, len(answer.content)
    assert stack.live.get(f"/v1/indexes/{index}", headers=ACME).status_code == 404
    listed = stack.live.get("/v1/ingestions", headers=ACME).json()["ingestions"]
    assert all(job["index"] != index for job in listed), listed


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/searches", SEARCH),  # Elasticsearch's _search is a GET with a body
        ("GET", "/v1/indexes/body-on-a-read/documents", {"ids": ["d1"]}),
        ("DELETE", "/v1/indexes/body-on-a-read/documents/d1", {"ids": ["d1", "d2"]}),
        ("DELETE", "/v1/indexes/body-on-a-read", {"ids": ["d2"]}),
    ],
)
def test_a_body_on_a_route_that_reads_none_is_422_naming_it(
    stack: Stack, method: str, path: str, body: dict[str, Any]
) -> None:
    """A ``GET`` or ``DELETE`` takes no body, so one sent is refused, as an unknown query
    parameter is, before anything is done: it was ignored, so an Elasticsearch user's
    ``GET /v1/searches`` with a search in its body was answered ``200`` with the list of
    past searches, and a ``DELETE`` of document ``d1`` with ``{"ids": ["d1", "d2"]}`` deleted
    ``d1`` alone, answered as done. Without a key it is 401; with no body, or an empty one,
    the route answers as before."""
    index = "/v1/indexes/body-on-a-read"
    documents = [{"id": "d1", "text": "green tea"}, {"id": "d2", "text": "black tea"}]
    written = stack.live.post(
        f"{index}/documents", params={"wait": 30}, json={"documents": documents}, headers=ACME
    )
    assert written.status_code == 200 and written.json()["status"] == "succeeded", written.text
    answer = stack.live.request(method, path, json=body, headers=ACME)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == "body", error
    route = path.replace("body-on-a-read", "{index}").replace("/d1", "/{id}")
    assert error["message"] == f"body: {method} {route} takes no body; send it without one"
    listed = stack.live.get(f"{index}/documents", headers=ACME).json()["documents"]
    assert [document["id"] for document in listed] == ["d1", "d2"]  # nothing deleted
    assert stack.live.request(method, path, json=body).status_code == 401
    for empty in (None, b""):
        assert stack.live.request(method, path, content=empty, headers=ACME).is_success
