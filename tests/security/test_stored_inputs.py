"""What a client sends as metadata, filters, titles and revisions: a 4xx naming the field, or
stored and read back exactly. Nothing the gateway accepts fails a job or poisons a record.

Over the real stack (uvicorn, Redis, a Celery worker on the embedded backend). Each of these
once passed the gateway:

* a metadata or filter key outside the backends' pattern (``a b``, ``""``, 129 characters):
  the ingest or search job failed later (``invalid_request``), after a ``202``;
* NaN, Infinity or 1e400 as a metadata or filter value (Python's JSON reader takes them):
  stored, written back as ``null``, and then every read of the record was a ``500``: the
  search, the tenant's whole ``GET /v1/searches``, and every search whose hits held the
  document;
* an integer past 64 bits: a filter on it failed the search (``OverflowError``, SQLite);
* a lone surrogate (``"\\ud800"``) in a filter: a ``500`` at the gateway; in a title, a
  revision or a metadata value: the ingest failed as ``internal_error``;
* two documents with one id in one request: the job said succeeded and the later one was
  silently dropped;
* a body not in UTF-8 (or -16, -32), or nested past Python's recursion limit: ``400``
  naming no field; so were ``401`` and ``403``;
* a JSON body sent under another Content-Type (``curl -d`` sends a form's): ``422`` saying
  the body "should be a valid dictionary"; now ``415`` naming the type it came as;
* a path no route has (an index name with ``%2F``) or a method a route lacks: ``404`` /
  ``405`` naming no field; now ``path`` / ``method``.

The property test sends generated metadata and filters (keys and values of any JSON type,
with NaN, infinities, huge integers, surrogates, NUL and control characters) and checks,
against the test's own account of what is storable (:func:`refused_fields`), that a request
holding an entry that cannot be stored is refused naming that entry, and that every other is
stored, read back and filtered on exactly, with the tenant's search list still readable.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from api_gateway.queue import OutboxSender
from tests.e2e.conftest import ACME, GLOBEX, Stack
from tests.security.test_limits import names_the_field
from worker.constants import INGEST_QUEUE, INGEST_TASK, MAX_METADATA_VALUE_BYTES
from worker.contract import DocumentIn
from worker.queue.jobstore import JobStore

INDEX = "stored-inputs"
JSON = {"content-type": "application/json"}


def send(client: httpx.Client, method: str, path: str, body: Any, headers: Any = ACME,
         **params: Any) -> httpx.Response:  # fmt: skip
    """``body`` as Python's JSON writer writes it, NaN and lone surrogates included (what a
    careless client's ``json.dumps`` sends)."""
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return client.request(method, path, content=raw, headers={**headers, **JSON}, params=params)


def ingest(stack: Stack, documents: list[dict[str, Any]], headers: Any = ACME) -> httpx.Response:
    return send(stack.live, "POST", f"/v1/indexes/{INDEX}/documents", {"documents": documents},
                headers, wait=20)  # fmt: skip


def search(stack: Stack, headers: Any = ACME, **fields: Any) -> httpx.Response:
    body = {"index": INDEX, "query": "hello", "mode": "fts", **fields}
    return send(stack.live, "POST", "/v1/searches", body, headers, wait=20)


@pytest.fixture(scope="module", autouse=True)
def indexed(stack: Stack) -> Iterator[None]:
    """Both tenants hold the index, so a search of it runs (rather than failing
    ``index_not_found``)."""
    for headers in (ACME, GLOBEX):
        response = ingest(stack, [{"id": "seed", "text": "hello seed"}], headers)
        assert response.status_code == 200, response.text
    yield


def list_is_readable(stack: Stack, headers: Any = ACME) -> None:
    """The tenant's search list reads (one record that cannot be read made it a 500)."""
    for status in (None, "failed", "succeeded"):
        params = {"page_size": 1000, **({"status": status} if status else {})}
        listed = stack.live.get("/v1/searches", params=params, headers=headers)
        assert listed.status_code == 200, listed.text


# --- values each backend cannot store or compare: refused, naming the field ----------------

BAD_VALUES = {
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
    "2^63": 2**63,
    "-2^63 - 1": -(2**63) - 1,
    "2^64": 2**64,
    "10^30": 10**30,
    "lone surrogate": "\ud800",
    "surrogate in text": "ok \udfff ok",
    "8,193 bytes": "x" * (MAX_METADATA_VALUE_BYTES + 1),
    "2,049 four-byte characters": "\U0001f600" * (MAX_METADATA_VALUE_BYTES // 4 + 1),
    "null": None,
    "a list": [1],
    "an object": {"a": 1},
}
BAD_KEYS = {
    "space": "a b",
    "empty": "",
    "quote": 'a"b',
    "dollar": "$.a",
    "slash": "a/b",
    "NUL": "a\x00b",
    "non-ASCII": "é",
    "129 characters": "k" * 129,
    "lone surrogate": "\ud800",
}


def _key_field(prefix: str, key: str) -> str:
    """The field an error about ``key`` names (pydantic shows a lone surrogate's three
    bytes as three U+FFFD)."""
    return f"{prefix}.{key.encode('utf-8', 'surrogatepass').decode('utf-8', 'replace')}"


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_a_metadata_value_no_backend_can_hold_is_422_naming_it(stack: Stack, value: Any) -> None:
    response = ingest(stack, [{"id": "v", "text": "hello", "metadata": {"x": value}}])
    names_the_field(response, 422, "documents[0].metadata.x")


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_a_metadata_key_no_backend_can_filter_on_is_422_naming_it(stack: Stack, key: str) -> None:
    response = ingest(stack, [{"id": "k", "text": "hello", "metadata": {key: 1}}])
    error = names_the_field(response, 422, _key_field("documents[0].metadata", key))
    assert "pattern" in error["message"] or "unicode" in error["message"], error


@pytest.mark.parametrize("field", ["title", "revision"])
def test_a_title_or_revision_with_a_lone_surrogate_is_422_naming_it(
    stack: Stack, field: str
) -> None:
    response = ingest(stack, [{"id": "s", "text": "hello", field: "title \ud83d"}])
    names_the_field(response, 422, f"documents[0].{field}")


def test_two_documents_with_one_id_are_422_naming_the_second(stack: Stack) -> None:
    documents = [
        {"id": "dup-0", "text": "first"},
        {"id": "dup", "text": "one"},
        {"id": "dup", "text": "two"},
    ]
    error = names_the_field(ingest(stack, documents), 422, "documents[2].id")
    assert "documents[1]" in error["message"]
    # nothing was written: neither version, nor the other document of the request
    for doc_id in ("dup", "dup-0"):
        got = stack.live.get(f"/v1/indexes/{INDEX}/documents/{doc_id}", headers=ACME)
        assert got.status_code == 404, got.text


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_a_filter_value_no_backend_can_compare_is_422_naming_it(stack: Stack, value: Any) -> None:
    names_the_field(search(stack, filters={"x": value}), 422, "filters.x")
    batch = {"index": INDEX, "queries": [{"id": "q", "query": "hello", "filters": {"x": value}}]}
    response = send(stack.live, "POST", "/v1/batches", batch)
    names_the_field(response, 422, "queries[0].filters.x")
    list_is_readable(stack)


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_a_filter_key_no_backend_can_filter_on_is_422_naming_it(stack: Stack, key: str) -> None:
    names_the_field(search(stack, filters={key: 1}), 422, _key_field("filters", key))
    batch = {"index": INDEX, "queries": [{"id": "q", "query": "hello", "filters": {key: 1}}]}
    response = send(stack.live, "POST", "/v1/batches", batch)
    names_the_field(response, 422, _key_field("queries[0].filters", key))


# --- the bodies and headers a 4xx named no field for ---------------------------------------

BODY_ROUTES = [
    ("POST", "/v1/searches"),
    ("POST", "/v1/batches"),
    ("POST", f"/v1/indexes/{INDEX}/documents"),
    ("POST", f"/v1/indexes/{INDEX}/documents/delete"),
    ("PATCH", f"/v1/indexes/{INDEX}"),
]


UNREADABLE = {
    "Latin-1": b'{"index": "caf\xe9", "query": "\xff"}',  # not UTF-8, -16 or -32
    "nested too deep": b'{"filters": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
}


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
def test_a_body_json_cannot_read_is_400_naming_body(
    stack: Stack, method: str, path: str, raw: bytes
) -> None:
    response = stack.live.request(method, path, content=raw, headers={**ACME, **JSON})
    error = names_the_field(response, 400, "body")
    assert error["type"] == "invalid_request"


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data", None]
)
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
def test_a_body_not_sent_as_json_is_415_naming_body_and_the_content_type(
    stack: Stack, method: str, path: str, content_type: str | None
) -> None:
    """``curl -d '{...}'`` sends a form's Content-Type: the body was left unread and the
    answer was a 422 saying it "should be a valid dictionary". ``POST /v1/batches``, which
    reads its body itself, took it whatever the Content-Type said, or none."""
    raw = json.dumps({"index": INDEX, "query": "hello", "ids": ["a"], "documents": []})
    headers = {**ACME, **({"content-type": content_type} if content_type else {})}
    response = stack.live.request(method, path, content=raw.encode(), headers=headers)
    error = names_the_field(response, 415, "body")
    assert "application/json" in error["message"], error
    assert (content_type or "without a Content-Type") in error["message"], error


@pytest.mark.parametrize(
    ("method", "path", "status", "field"),
    [
        ("GET", "/v1/nope", 404, "path"),
        ("GET", "/v1/indexes/a%2Fb", 422, "index"),
        ("POST", "/v1/indexes/a%2Fb/documents", 422, "index"),
        ("GET", "/v1%2Findexes", 404, "path"),
        ("GET", "/docs/assets/nope.js", 404, "path"),
        ("PUT", "/v1/searches", 405, "method"),
        ("PATCH", "/v1/searches/srch_0", 405, "method"),
    ],
)
def test_a_path_or_method_no_route_has_is_a_4xx_naming_it(
    stack: Stack, method: str, path: str, status: int, field: str
) -> None:
    """``404`` "Not Found" used to name no field (nor did ``405``). An index name holding
    ``%2F`` stays one path segment (the gateway routes on the raw path): it reaches the
    index's route, whose pattern refuses the ``/`` by name; a ``%2F`` in a route's own text
    matches no route."""
    response = stack.live.request(method, path, headers=ACME)
    names_the_field(response, status, field)


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Basic YTpi"}, 401), ({"Authorization": "Bearer nope"}, 403)],
)
def test_a_missing_or_unknown_key_names_authorization(
    stack: Stack, headers: dict[str, str], status: int
) -> None:
    names_the_field(stack.live.get("/v1/searches", headers=headers), status, "Authorization")


# --- what is accepted is stored, read back and filtered on exactly --------------------------

EDGE_METADATA: dict[str, Any] = {
    "int64_max": 2**63 - 1,
    "int64_min": -(2**63),
    "zero": 0,
    "float": 1.5,
    "integral_float": 5.0,
    "negative_zero": -0.0,
    "smallest": 5e-324,
    "largest": 1.7976931348623157e308,
    "true": True,
    "false": False,
    "empty": "",
    "nul": "a\x00b",
    "control": "\x01\x1f",
    "newline": "a\nb",
    "quotes": 'it\'s "quoted"',
    "backslash": "a\\b",
    "emoji": "\U0001f600",
    "rtl": "\u202eabc",
    "json_path": "$.x",
    "longest_string": "\u00e9" * (MAX_METADATA_VALUE_BYTES // 2),
    "a.b:c-d_E9": "every allowed key character",
    "k" * 128: "the longest key",
}


def test_every_value_the_gateway_accepts_is_stored_read_back_and_filtered_on(
    stack: Stack,
) -> None:
    document = {
        "id": "edges \x00 \U0001f600",
        "text": "hello edges",
        "title": "t\x00\U0001f600",
        "revision": "r\x00",
        "metadata": EDGE_METADATA,
    }
    response = ingest(stack, [document], GLOBEX)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded", response.text
    path = f"/v1/indexes/{INDEX}/documents/{urllib.parse.quote(document['id'], safe='')}"
    stored = stack.live.get(path, headers=GLOBEX)
    assert stored.status_code == 200, stored.text
    body = stored.json()
    assert (body["title"], body["revision"]) == (document["title"], document["revision"])
    assert body["metadata"] == EDGE_METADATA
    assert {k: type(v) for k, v in body["metadata"].items()} == {
        k: type(v) for k, v in EDGE_METADATA.items()
    }
    for key, value in EDGE_METADATA.items():
        found = search(stack, GLOBEX, query="edges", filters={key: value})
        assert found.status_code == 200, found.text
        assert found.json()["status"] == "succeeded", (key, found.text)
        hits = [hit["id"] for hit in found.json()["result"]["hits"]]
        assert hits == [document["id"]], (key, value, hits)
        assert found.json()["result"]["hits"][0]["metadata"] == EDGE_METADATA
    list_is_readable(stack, GLOBEX)


# --- generated: refused naming the field, or stored and filtered on exactly -----------------

allowed_keys = st.text(alphabet="abcXYZ019_.:-", min_size=1, max_size=8)
any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=8)  # surrogates too
storable = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),  # subnormals, -0.0, the largest
    st.booleans(),
)
unstorable = st.one_of(
    any_text,
    st.integers(min_value=2**63, max_value=2**70) | st.integers(max_value=-(2**63) - 1),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
keys = st.one_of(allowed_keys, any_text, st.just("k" * 129))
values = st.one_of(storable, unstorable)
# half all storable (to be stored and filtered on), half anything (to be refused or stored)
generated = st.one_of(
    st.dictionaries(allowed_keys, storable, max_size=4), st.dictionaries(keys, values, max_size=4)
)
rounds = iter(range(10**6))


# the two property tests' runs: 60 examples each, the same on every run (CI included)
GENERATED_RUNS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


STORABLE_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _storable(value: Any) -> bool:
    """What docs/indexes.md promises to store: a UTF-8 string (of at most
    ``MAX_METADATA_VALUE_BYTES``), a 64-bit integer, a finite float, a boolean."""
    if isinstance(value, str):
        try:
            return len(value.encode()) <= MAX_METADATA_VALUE_BYTES
        except UnicodeEncodeError:  # a lone surrogate
            return False
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -(2**63) <= value <= 2**63 - 1
    return isinstance(value, float) and math.isfinite(value)


def refused_fields(mapping: dict[str, Any], prefix: str) -> set[str]:
    """The fields a 422 may name for ``mapping`` sent as ``prefix``: each entry whose key or
    value cannot be stored. Empty: the whole mapping must be accepted."""
    return {
        _key_field(prefix, key)
        for key, value in mapping.items()
        if not (STORABLE_KEY.fullmatch(key) and _storable(value))
    }


def assert_refused_naming(response: httpx.Response, fields: set[str]) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] in fields, (error, fields)
    assert error["message"].startswith(f"{error['field']}: "), error


@GENERATED_RUNS
@given(metadata=generated)
def test_generated_metadata_is_refused_naming_it_or_stored_and_found_exactly(
    stack: Stack, metadata: dict[str, Any]
) -> None:
    doc_id = f"gen-{next(rounds)}"
    response = ingest(stack, [{"id": doc_id, "text": "hello generated", "metadata": metadata}])
    refused = refused_fields(metadata, "documents[0].metadata")
    event(f"answered {response.status_code}")
    if refused:
        assert_refused_naming(response, refused)
        return
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded", response.text
    stored = stack.live.get(f"/v1/indexes/{INDEX}/documents/{doc_id}", headers=ACME)
    assert stored.status_code == 200 and stored.json()["metadata"] == metadata, stored.text
    found = search(stack, query="generated", filters=metadata, limit=100)
    assert found.status_code == 200 and found.json()["status"] == "succeeded", found.text
    assert doc_id in [hit["id"] for hit in found.json()["result"]["hits"]]


@GENERATED_RUNS
@given(filters=generated)
def test_generated_filters_are_refused_naming_them_or_the_search_succeeds(
    stack: Stack, filters: dict[str, Any]
) -> None:
    response = search(stack, filters=filters)
    refused = refused_fields(filters, "filters")
    event(f"answered {response.status_code}")
    if refused:
        assert_refused_naming(response, refused)
    else:
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "succeeded", response.text
        got = stack.live.get(f"/v1/searches/{response.json()['id']}", headers=ACME)
        assert got.status_code == 200, got.text
    list_is_readable(stack)


# --- what the previous release let in stays readable ------------------------------------


def ingest_as_before(stack: Stack, doc_id: str, text: str) -> None:
    """Ingest one document with NaN and Infinity in its metadata, written to the job store as
    the previous release's gateway stored it (today's refuses them), run by the real worker."""
    store = JobStore.from_url(stack.redis_url + "/0")
    outbox = OutboxSender(store)
    metadata: dict[str, Any] = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1.5}
    try:
        job = store.create_ingest(
            "acme",
            INDEX,
            [DocumentIn(id=doc_id, text=text, metadata=metadata)],
            enqueue=lambda job_id: outbox.messages([(INGEST_TASK, [job_id], INGEST_QUEUE)]),
        )
    finally:
        store.close()
    for _ in range(400):
        ingested = stack.live.get(f"/v1/ingestions/{job.id}", headers=ACME).json()
        if ingested["status"] != "queued" and ingested["status"] != "running":
            break
        time.sleep(0.05)
    assert ingested["status"] == "succeeded", ingested


def test_a_document_stored_with_nan_metadata_before_the_check_does_not_break_searches(
    stack: Stack,
) -> None:
    """An ingest job as the previous release's gateway stored it, NaN and Infinity in the
    metadata, run by the real worker. The backend holds the values; a search returning the
    document wrote its hits' metadata back as ``null``, which no read of the result took:
    every search returning the document was a 500, and so was the tenant's search list,
    for as long as the document stayed. A hit now shows the value by name."""
    ingest_as_before(stack, "legacy-nan", "hello legacy")
    found = search(stack, query="legacy", filters={"ok": 1.5})
    assert found.status_code == 200, found.text
    assert found.json()["status"] == "succeeded", found.text
    hit = found.json()["result"]["hits"][0]
    assert hit["id"] == "legacy-nan"
    assert hit["metadata"] == {"nan": "NaN", "inf": "Infinity", "ninf": "-Infinity", "ok": 1.5}
    again = stack.live.get(f"/v1/searches/{found.json()['id']}", headers=ACME)
    assert again.status_code == 200 and again.json()["result"]["hits"][0] == hit, again.text
    list_is_readable(stack)


def test_a_document_stored_with_nan_metadata_before_the_check_can_be_read_by_id(
    stack: Stack,
) -> None:
    """``GET /v1/indexes/{index}/documents/{id}`` of such a document: the worker's answer
    carried the value as JSON's ``NaN``, which the gateway's JSON response cannot write, a
    500 for as long as the document stayed. It shows the value by name, as a hit does."""
    ingest_as_before(stack, "legacy-nan-doc", "hello legacy doc")
    got = stack.live.get(f"/v1/indexes/{INDEX}/documents/legacy-nan-doc", headers=ACME)
    assert got.status_code == 200, got.text
    shown = {"nan": "NaN", "inf": "Infinity", "ninf": "-Infinity", "ok": 1.5}
    assert got.json()["metadata"] == shown, got.text
