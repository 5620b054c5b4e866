"""Every documented limit answers 413 or 422 with a message that names the field.

Through the real gateways of the stack: ``idle`` (no worker, a 64 KiB body limit) for
most, ``live`` (the default 32 MiB body limit) where a request must be big to pass a count
limit. Every over-limit request is refused before anything is stored or enqueued. The
limits table of docs/security.md is checked against :mod:`worker.constants` here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ACME, IDLE_BODY_LIMIT, INDEX, Stack
from worker.constants import (
    MAX_BATCH_QUERIES,
    MAX_BATCH_QUERY_ID_CHARS,
    MAX_DOCUMENT_CHARS,
    MAX_DOCUMENTS_PER_REQUEST,
    MAX_FILTER_KEYS,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_LIMIT,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_BYTES,
    MAX_PAGE_SIZE,
    MAX_QUERY_CHARS,
    MAX_REVISION_CHARS,
    MAX_TITLE_CHARS,
    MAX_WAIT_SECONDS,
    MAX_WEBHOOK_URL_CHARS,
)
from worker.settings import Settings

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
HOOK = "http://93.184.216.34/hook"


def names_the_field(response: httpx.Response, status: int, field: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"].startswith(f"{field}: "), error
    return error


def search(**overrides: Any) -> dict[str, Any]:
    return {"index": INDEX, "query": "green tea", **overrides}


def batch(queries: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    return {"index": INDEX, "queries": queries, **overrides}


def docs(*texts: str) -> dict[str, Any]:
    return {"documents": [{"id": str(i), "text": t} for i, t in enumerate(texts)]}


# --- the body -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_naming_the_limit(stack: Stack) -> None:
    padding = "x" * IDLE_BODY_LIMIT
    response = stack.idle.post("/v1/searches", json=search(query=padding), headers=ACME)
    error = names_the_field(response, 413, "body")
    assert error["type"] == "payload_too_large"
    assert f"larger than the limit of {IDLE_BODY_LIMIT} bytes" in error["message"]


def test_a_chunked_body_over_the_limit_is_413_too(stack: Stack) -> None:
    """No Content-Length to trust: the gateway counts what arrives."""

    def chunks() -> Iterator[bytes]:
        yield b'{"index":"docs","query":"'
        for _ in range(IDLE_BODY_LIMIT // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    response = stack.idle.post(
        "/v1/searches",
        content=chunks(),
        headers={**ACME, "content-type": "application/json"},
    )
    names_the_field(response, 413, "body")


def padded_search(size: int) -> bytes:
    """A valid search body of exactly ``size`` bytes: JSON whitespace before its closing brace."""
    body = json.dumps(search()).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


@pytest.mark.parametrize("size", [IDLE_BODY_LIMIT - 1, IDLE_BODY_LIMIT])
def test_a_body_up_to_the_limit_is_read(stack: Stack, size: int) -> None:
    """The limit is inclusive: a body of exactly ``SIFT_MAX_BODY_BYTES`` is read and stored."""
    body = padded_search(size)
    assert len(body) == size
    headers = {**ACME, "content-type": "application/json"}
    response = stack.idle.post("/v1/searches", content=body, headers=headers)
    assert response.status_code == 202, response.text


def test_a_body_one_byte_over_the_limit_is_413(stack: Stack) -> None:
    headers = {**ACME, "content-type": "application/json"}
    response = stack.idle.post(
        "/v1/searches", content=padded_search(IDLE_BODY_LIMIT + 1), headers=headers
    )
    names_the_field(response, 413, "body")


# --- searches -------------------------------------------------------------------------------


def test_a_query_at_the_limit_is_accepted(stack: Stack) -> None:
    response = stack.idle.post(
        "/v1/searches", json=search(query="q" * MAX_QUERY_CHARS), headers=ACME
    )
    assert response.status_code == 202, response.text


def test_a_query_over_the_limit_is_422_naming_query(stack: Stack) -> None:
    response = stack.idle.post(
        "/v1/searches", json=search(query="q" * (MAX_QUERY_CHARS + 1)), headers=ACME
    )
    error = names_the_field(response, 422, "query")
    assert str(MAX_QUERY_CHARS) in error["message"]


@pytest.mark.parametrize("query", ["", "   \n\t "])
def test_an_empty_query_is_422_naming_query(stack: Stack, query: str) -> None:
    names_the_field(
        stack.idle.post("/v1/searches", json=search(query=query), headers=ACME), 422, "query"
    )


@pytest.mark.parametrize("limit", [0, -1, MAX_LIMIT + 1, 10**12])
def test_limit_out_of_range_is_422_naming_limit(stack: Stack, limit: int) -> None:
    response = stack.idle.post("/v1/searches", json=search(limit=limit), headers=ACME)
    names_the_field(response, 422, "limit")


@pytest.mark.parametrize("limit", [1, MAX_LIMIT])
def test_limit_at_its_bounds_is_accepted(stack: Stack, limit: int) -> None:
    assert (
        stack.idle.post("/v1/searches", json=search(limit=limit), headers=ACME).status_code == 202
    )


@pytest.mark.parametrize("wait", [-1, MAX_WAIT_SECONDS + 1])
def test_wait_out_of_range_is_422_naming_wait(stack: Stack, wait: float) -> None:
    response = stack.idle.post("/v1/searches", params={"wait": wait}, json=search(), headers=ACME)
    names_the_field(response, 422, "wait")


def test_a_webhook_url_over_the_limit_is_422_naming_webhook_url(stack: Stack) -> None:
    url = HOOK + "?" + "a" * MAX_WEBHOOK_URL_CHARS
    response = stack.idle.post("/v1/searches", json=search(webhook_url=url), headers=ACME)
    names_the_field(response, 422, "webhook_url")


def test_an_idempotency_key_over_the_limit_is_422_naming_it(stack: Stack) -> None:
    headers = {**ACME, "Idempotency-Key": "k" * (MAX_IDEMPOTENCY_KEY_CHARS + 1)}
    response = stack.idle.post("/v1/searches", json=search(), headers=headers)
    names_the_field(response, 422, "Idempotency-Key")


def test_an_idempotency_keys_limit_counts_bytes_as_sent(stack: Stack) -> None:
    """The limit is in bytes, as docs/security.md says (it said characters): the server
    reads a header's bytes one character each, so 128 ``é`` sent in UTF-8 (256 bytes) are
    over it, and 255 ASCII bytes are not."""
    accented = {**ACME, "Idempotency-Key": "\u00e9".encode() * 128}
    refused = stack.idle.post("/v1/searches", json=search(), headers=accented)
    names_the_field(refused, 422, "Idempotency-Key")
    ascii_key = {**ACME, "Idempotency-Key": b"k" * MAX_IDEMPOTENCY_KEY_CHARS}
    assert stack.idle.post("/v1/searches", json=search(), headers=ascii_key).status_code == 202


def test_an_idempotency_keys_422_says_its_limit_in_bytes(stack: Stack) -> None:
    """A key of 129 characters (two ASCII, 127 ``é``) is 256 bytes sent in UTF-8, one over the
    limit: refused, its message says the limit in bytes, as the limit is counted (it said
    "at most 255 characters", of a key of 129). One byte fewer is taken."""
    over = b"kk" + "\u00e9".encode() * 127
    assert len(over) == MAX_IDEMPOTENCY_KEY_CHARS + 1
    refused = stack.idle.post(
        "/v1/searches", json=search(), headers={**ACME, "Idempotency-Key": over}
    )
    error = names_the_field(refused, 422, "Idempotency-Key")
    assert f"at most {MAX_IDEMPOTENCY_KEY_CHARS} bytes" in error["message"], error
    assert "characters" not in error["message"], error
    taken = {**ACME, "Idempotency-Key": over[1:]}
    assert stack.idle.post("/v1/searches", json=search(), headers=taken).status_code == 202


def test_an_index_name_over_the_limit_is_422_naming_index(stack: Stack) -> None:
    response = stack.idle.post("/v1/searches", json=search(index="a" * 129), headers=ACME)
    names_the_field(response, 422, "index")


# --- batches --------------------------------------------------------------------------------


def test_too_many_queries_in_a_batch_is_422_naming_queries(stack: Stack) -> None:
    queries = [{"id": str(i), "query": "q"} for i in range(MAX_BATCH_QUERIES + 1)]
    response = stack.live.post("/v1/batches", json=batch(queries), headers=ACME)
    error = names_the_field(response, 422, "queries")
    assert f"{MAX_BATCH_QUERIES}" in error["message"].replace(",", "").replace("_", "")


def test_an_empty_batch_is_422_naming_queries(stack: Stack) -> None:
    names_the_field(stack.idle.post("/v1/batches", json=batch([]), headers=ACME), 422, "queries")


def test_a_batch_query_over_the_limit_names_its_place(stack: Stack) -> None:
    queries = [{"id": str(i), "query": "q"} for i in range(5)]
    queries[3]["query"] = "q" * (MAX_QUERY_CHARS + 1)
    response = stack.idle.post("/v1/batches", json=batch(queries), headers=ACME)
    names_the_field(response, 422, "queries[3].query")


def test_a_batch_limit_out_of_range_names_its_place(stack: Stack) -> None:
    queries = [{"id": "a", "query": "q"}, {"id": "b", "query": "q", "limit": MAX_LIMIT + 1}]
    response = stack.idle.post("/v1/batches", json=batch(queries), headers=ACME)
    names_the_field(response, 422, "queries[1].limit")


def test_a_batch_query_id_over_the_limit_names_its_place(stack: Stack) -> None:
    queries = [{"id": "i" * (MAX_BATCH_QUERY_ID_CHARS + 1), "query": "q"}]
    response = stack.idle.post("/v1/batches", json=batch(queries), headers=ACME)
    names_the_field(response, 422, "queries[0].id")


@pytest.mark.parametrize("page_size", [0, -5, MAX_PAGE_SIZE + 1])
def test_page_size_out_of_range_is_422_naming_page_size(stack: Stack, page_size: int) -> None:
    created = stack.idle.post("/v1/batches", json=batch([{"id": "1", "query": "q"}]), headers=ACME)
    assert created.status_code == 202, created.text
    response = stack.idle.get(
        f"/v1/batches/{created.json()['id']}/results",
        params={"page_size": page_size},
        headers=ACME,
    )
    names_the_field(response, 422, "page_size")


def test_a_forged_page_token_is_422_naming_page_token(stack: Stack) -> None:
    created = stack.idle.post("/v1/batches", json=batch([{"id": "1", "query": "q"}]), headers=ACME)
    response = stack.idle.get(
        f"/v1/batches/{created.json()['id']}/results",
        params={"page_token": "bm90LWEtdG9rZW4"},
        headers=ACME,
    )
    names_the_field(response, 422, "page_token")


# --- documents ------------------------------------------------------------------------------


def test_too_many_documents_is_422_naming_documents(stack: Stack) -> None:
    body = docs(*(["d"] * (MAX_DOCUMENTS_PER_REQUEST + 1)))
    response = stack.idle.post(f"/v1/indexes/{INDEX}/documents", json=body, headers=ACME)
    error = names_the_field(response, 422, "documents")
    assert str(MAX_DOCUMENTS_PER_REQUEST) in error["message"]


def test_a_document_text_over_the_limit_names_its_place(stack: Stack) -> None:
    body = docs("fine", "t" * (MAX_DOCUMENT_CHARS + 1))
    response = stack.live.post(f"/v1/indexes/{INDEX}/documents", json=body, headers=ACME)
    error = names_the_field(response, 422, "documents[1].text")
    assert str(MAX_DOCUMENT_CHARS) in error["message"]


OVER = {
    "title": "t" * (MAX_TITLE_CHARS + 1),
    "revision": "r" * (MAX_REVISION_CHARS + 1),
    "metadata": {f"k{i}": i for i in range(MAX_METADATA_KEYS + 1)},
}


@pytest.mark.parametrize(("field", "value"), OVER.items(), ids=OVER.keys())
def test_a_document_title_revision_or_metadata_over_its_limit_names_its_place(
    stack: Stack, field: str, value: object
) -> None:
    """Only the text had a limit: a 5 MB title was stored, and answered in every listing
    page and every hit that showed the document (a 23 MB search answer); 200,000 metadata
    keys likewise. Nothing of the request is stored."""
    body = {"documents": [{"id": "big", "text": "fine"}, {"id": "big2", "text": "t", field: value}]}
    response = stack.live.post(f"/v1/indexes/{INDEX}/documents", json=body, headers=ACME)
    error = names_the_field(response, 422, f"documents[1].{field}")
    if isinstance(value, str):  # as the text's and the id's: it said "at most 2000 items"
        assert error["message"].endswith(f"at most {len(value) - 1} characters"), error
    read = stack.live.get(f"/v1/indexes/{INDEX}/documents/big", headers=ACME)
    assert read.status_code == 404, read.text


def test_an_empty_revision_is_422_naming_its_place(stack: Stack) -> None:
    """An explicit ``"revision": ""`` was taken, and the document stored under a digest of
    its content, as if no revision were given; the OpenAPI document says so too."""
    body = {"documents": [{"id": "no-revision", "text": "fine", "revision": ""}]}
    response = stack.idle.post(f"/v1/indexes/{INDEX}/documents", json=body, headers=ACME)
    error = names_the_field(response, 422, "documents[0].revision")
    assert error["message"].endswith("at least 1 character"), error
    spec = stack.idle.get("/openapi.json").json()
    revision = spec["components"]["schemas"]["DocumentRequest"]["properties"]["revision"]
    assert {"type": "string", "minLength": 1, "maxLength": MAX_REVISION_CHARS} in revision[
        "anyOf"
    ], revision


def test_a_document_at_each_limit_is_stored(stack: Stack) -> None:
    at = {
        key: (v[:-1] if isinstance(v, str) else dict(list(v.items())[:-1]))
        for key, v in OVER.items()
    }
    body = {"documents": [{"id": "at-limits", "text": "fine", **at}]}
    response = stack.live.post(
        f"/v1/indexes/{INDEX}/documents", params={"wait": 30}, json=body, headers=ACME
    )
    assert response.status_code == 200 and response.json()["upserted"] == 1, response.text
    read = stack.live.get(f"/v1/indexes/{INDEX}/documents/at-limits", headers=ACME).json()
    assert (read["title"], read["revision"], read["metadata"]) == (
        at["title"],
        at["revision"],
        at["metadata"],
    )


def test_the_openapi_document_shows_each_document_limit(stack: Stack) -> None:
    """The text's limit was checked by the route alone: the served document showed none."""
    spec = stack.idle.get("/openapi.json").json()
    fields = spec["components"]["schemas"]["DocumentRequest"]["properties"]
    assert (fields["text"].get("minLength"), fields["text"].get("maxLength")) == (
        1,
        MAX_DOCUMENT_CHARS,
    ), fields["text"]
    assert fields["title"]["maxLength"] == MAX_TITLE_CHARS, fields["title"]


def test_an_empty_document_text_names_its_place(stack: Stack) -> None:
    response = stack.idle.post(f"/v1/indexes/{INDEX}/documents", json=docs("ok", " "), headers=ACME)
    names_the_field(response, 422, "documents[1].text")


def test_a_document_id_over_the_limit_names_its_place(stack: Stack) -> None:
    body = {"documents": [{"id": "i" * 513, "text": "t"}]}
    response = stack.idle.post(f"/v1/indexes/{INDEX}/documents", json=body, headers=ACME)
    names_the_field(response, 422, "documents[0].id")


def test_a_filter_of_too_many_keys_is_422_naming_it(stack: Stack) -> None:
    """A search's filter keys are ANDed in one SQL expression, and SQLite refuses one deeper
    than 1,000: a search of 1,000 keys was accepted, then failed as the server's
    ``backend_request_error`` ("Expression tree is too large"), and so did each item of a
    batch. At most 100 keys (numbers take two terms each): the most is still a search."""
    doc = {"id": "d", "text": "green tea", "metadata": {"k0": 0}}
    ingested = stack.live.post(
        "/v1/indexes/filter-keys/documents", params={"wait": 20}, json={"documents": [doc]},
        headers=ACME,
    )  # fmt: skip
    assert ingested.status_code == 200, ingested.text
    most = {f"k{i}": i for i in range(MAX_FILTER_KEYS)}
    done = stack.live.post(
        "/v1/searches", params={"wait": 20}, json=search(index="filter-keys", filters=most),
        headers=ACME,
    )  # fmt: skip
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
    assert done.json()["result"]["hits"] == []  # the document has one of the keys only
    over = {**most, "one-more": 0}
    for path, body, field in (
        ("/v1/searches", search(filters=over), "filters"),
        ("/v1/batches", {"index": INDEX, "queries": [{"id": "a", "query": "x", "filters": over}]},
         "queries[0].filters"),
    ):  # fmt: skip
        response = stack.live.post(path, json=body, headers=ACME)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == field and str(MAX_FILTER_KEYS) in error["message"], error


# --- the docs ------------------------------------------------------------------------------


def test_the_documented_limits_table_matches_the_code() -> None:
    """Each row of docs/security.md's limits table (``| what | limit | answer |``) is the code's."""
    text = SECURITY_DOC.read_text()
    section = text[text.index("### Limits") :]
    section = section[: section.index("\n\n", section.index("|"))]
    rows = {
        cells[0]: cells[1]
        for line in section.splitlines()
        if line.startswith("| `")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }

    def number(cell: str) -> list[int]:
        return [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", cell)]

    expected = {
        "`query`, `queries[i].query`": [MAX_QUERY_CHARS],
        "`limit`, `queries[i].limit`": [1, MAX_LIMIT],
        "`queries`": [1, MAX_BATCH_QUERIES],
        "`queries[i].id`": [MAX_BATCH_QUERY_ID_CHARS],
        "`documents`": [1, MAX_DOCUMENTS_PER_REQUEST],
        "`documents[i].text`": [MAX_DOCUMENT_CHARS],
        "`documents[i].id`": [512],
        "`documents[i].title`": [MAX_TITLE_CHARS],
        "`documents[i].revision`": [1, MAX_REVISION_CHARS],
        "`documents[i].metadata`": [MAX_METADATA_KEYS],
        "`documents[i].metadata`, `filters`, `queries[i].filters`": [
            1,
            MAX_METADATA_KEY_CHARS,
            MAX_METADATA_VALUE_BYTES,
            8,
            64,
        ],
        "`filters`, `queries[i].filters`": [MAX_FILTER_KEYS],
        "`page_size`": [1, MAX_PAGE_SIZE],
        "`wait`": [0, int(MAX_WAIT_SECONDS)],
        "`webhook_url`": [MAX_WEBHOOK_URL_CHARS],
        "`Idempotency-Key`": [MAX_IDEMPOTENCY_KEY_CHARS],
        "`body`": [Settings().max_body_bytes],
    }
    assert {name: number(rows.get(name, "")) for name in expected} == expected
