"""Every client value that reaches Redis is checked first: a 4xx naming the field, never a 5xx.

Through the real ``idle`` gateway of the stack (uvicorn, Redis database 1, no worker). A page
token holding a huge offset used to reach ``LRANGE``, which Redis refused ("value is not an
integer or out of range"), and the gateway answered 503 "retry" and closed the keep-alive
connection; each case here is followed by a good request on the same connection. Ids that
are not of the store's shape never become part of a key name: under a key of another type
they would have made Redis refuse the read. A Redis error that is no connection failure is
the gateway's bug: 500, its traceback logged, the connection still open.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.conftest import ACME, INDEX, Stack
from tests.security.test_limits import names_the_field
from worker.constants import (
    BATCH_ID_PREFIX,
    BATCH_KEY,
    BATCH_ORDER_KEY,
    INGEST_ID_PREFIX,
    INGEST_KEY,
    MAX_BATCH_QUERIES,
    SEARCH_ID_PREFIX,
    SEARCH_KEY,
)


def token(text: str) -> str:
    """A page token the way the API writes one: url-safe base64 without padding."""
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def local_port(response: httpx.Response) -> int:
    """The client's port of the TCP connection the response came on."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


@pytest.fixture(scope="module")
def batch_id(stack: Stack) -> str:
    """A two-item batch on the idle gateway (its items stay queued)."""
    queries = [{"id": "a", "query": "green tea"}, {"id": "b", "query": "black tea"}]
    created = stack.idle.post(
        "/v1/batches", json={"index": INDEX, "queries": queries}, headers=ACME
    )
    assert created.status_code == 202, created.text
    return str(created.json()["id"])


@pytest.fixture(scope="module")
def store(stack: Stack) -> Iterator[redis.Redis]:
    """The idle gateway's Redis database, read and written directly."""
    client = redis.Redis.from_url(stack.redis_url + "/1", decode_responses=True)
    try:
        yield client
    finally:
        client.close()


def results(stack: Stack, batch_id: str, **params: Any) -> httpx.Response:
    return stack.idle.get(f"/v1/batches/{batch_id}/results", params=params, headers=ACME)


def still_usable(stack: Stack, batch_id: str, after: httpx.Response) -> None:
    """The connection ``after`` came on answers the next request."""
    again = results(stack, batch_id)
    assert again.status_code == 200, again.text
    assert local_port(again) == local_port(after)


# --- page tokens ----------------------------------------------------------------------------


def bound(batch_id: str, offset: str) -> str:
    """A results token for ``offset`` (any text) whose digest ties it to ``batch_id`` as the
    API's does, so the offset itself is what is checked."""
    digest = hashlib.blake2b(f"{batch_id}\0{offset}".encode(), digest_size=8).hexdigest()
    return token(f"r:{digest}:{offset}")


TOKENS = {
    "empty": "",
    "garbage": "!!not a token!!",
    "bad base64": "abc",
    "not utf-8": base64.urlsafe_b64encode(b"r:\xff\xfe").decode().rstrip("="),
    "a bare offset (another batch's read this one)": token("o:1"),
    "wrong prefix": token("x:1"),
    "no prefix": token("1"),
    "unicode": "ëñ✓",
    "too long": "A" * 65,
}
# offsets in a token whose digest is right for them: the offset is refused
OFFSETS = {
    "negative": "-1",
    "huge offset": "9" * 40,
    "2^63": f"{2**63}",
    "2^63 - 1": f"{2**63 - 1}",
    "past the largest batch": f"{MAX_BATCH_QUERIES + 1}",
    "float": "1.5",
    "exponent": "1e3",
    "unicode digits": "\u0661",
    "underscore": "1_0",
    "space": " 1",
    "leading zero": "01",
}


@pytest.mark.parametrize("value", TOKENS.values(), ids=TOKENS.keys())
def test_a_page_token_the_api_did_not_issue_is_422_naming_it(
    stack: Stack, batch_id: str, value: str
) -> None:
    response = results(stack, batch_id, page_token=value)
    names_the_field(response, 422, "page_token")
    still_usable(stack, batch_id, response)


@pytest.mark.parametrize("offset", OFFSETS.values(), ids=OFFSETS.keys())
def test_a_page_token_of_an_offset_the_api_never_issues_is_422_naming_it(
    stack: Stack, batch_id: str, offset: str
) -> None:
    response = results(stack, batch_id, page_token=bound(batch_id, offset))
    names_the_field(response, 422, "page_token")
    still_usable(stack, batch_id, response)


def test_the_tokens_the_api_issues_are_taken(stack: Stack, batch_id: str) -> None:
    first = results(stack, batch_id, page_size=1)
    assert first.status_code == 200, first.text
    issued = first.json()["next_page_token"]
    assert issued == bound(batch_id, "1")
    second = results(stack, batch_id, page_size=1, page_token=issued)
    assert second.status_code == 200, second.text
    assert [r["query_id"] for r in second.json()["results"]] == ["b"]
    assert second.json()["next_page_token"] is None
    padded = results(stack, batch_id, page_token=issued + "=")
    names_the_field(padded, 422, "page_token")
    # the largest offset a batch can have is still a token: past this batch, an empty page
    last = results(stack, batch_id, page_token=bound(batch_id, f"{MAX_BATCH_QUERIES}"))
    assert last.status_code == 200, last.text
    assert last.json() == {"results": [], "next_page_token": None}


# --- the other values -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "1.5", "1e3", str(2**63), str(2**70), "-1", "\u0661"])
def test_a_page_size_that_is_no_size_is_422_naming_it(
    stack: Stack, batch_id: str, value: str
) -> None:
    response = results(stack, batch_id, page_size=value)
    names_the_field(response, 422, "page_size")
    still_usable(stack, batch_id, response)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e309", "", "30.000001"])
def test_a_wait_that_is_no_wait_is_422_naming_it(stack: Stack, batch_id: str, value: str) -> None:
    body = {"index": INDEX, "query": "green tea"}
    response = stack.idle.post("/v1/searches", params={"wait": value}, json=body, headers=ACME)
    names_the_field(response, 422, "wait")
    still_usable(stack, batch_id, response)


def test_an_empty_idempotency_key_is_422_naming_it(stack: Stack) -> None:
    headers = {**ACME, "Idempotency-Key": ""}
    body = {"index": INDEX, "query": "green tea"}
    names_the_field(
        stack.idle.post("/v1/searches", json=body, headers=headers), 422, "Idempotency-Key"
    )


def test_an_idempotency_key_of_any_bytes_is_only_hashed(stack: Stack) -> None:
    """Header bytes outside ASCII (read as latin-1) name a key like any other: the same key
    and body again is the same job."""
    key = b"k\xe9\xff\x80" + uuid.uuid4().hex.encode()
    headers = [(b"Authorization", ACME["Authorization"].encode()), (b"Idempotency-Key", key)]
    body = {"index": INDEX, "query": "green tea"}
    first = stack.idle.post("/v1/searches", json=body, headers=headers)
    again = stack.idle.post("/v1/searches", json=body, headers=headers)
    assert first.status_code == again.status_code == 202, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]


# --- ids ------------------------------------------------------------------------------------

MALFORMED_IDS = {
    "planted": "planted",  # a key of another type is planted under this one, each prefix
    "long": "x" * 4000,
    "nul": "%00",
    "upper case": "{prefix}" + "A" * 32,
    "short": "{prefix}" + "a" * 31,
    "suffixed": "{prefix}" + "a" * 32 + ":x",
    "unicode": "{prefix}" + "é" * 32,
}
ROUTES = [
    ("GET", "/v1/searches/{}", SEARCH_ID_PREFIX),
    ("GET", "/v1/ingestions/{}", INGEST_ID_PREFIX),
    ("GET", "/v1/batches/{}", BATCH_ID_PREFIX),
    ("GET", "/v1/batches/{}/results", BATCH_ID_PREFIX),
    ("DELETE", "/v1/batches/{}", BATCH_ID_PREFIX),
]


@pytest.fixture(scope="module")
def planted(store: redis.Redis) -> Iterator[None]:
    """Keys of other types under each record prefix: reading one as a record would make
    Redis refuse (WRONGTYPE)."""
    keys = [SEARCH_KEY + "planted", INGEST_KEY + "planted", BATCH_KEY + "planted"]
    for key in keys:
        store.rpush(key, "not a record")
    try:
        yield
    finally:
        store.delete(*keys)


@pytest.mark.parametrize("shape", MALFORMED_IDS.values(), ids=MALFORMED_IDS.keys())
@pytest.mark.parametrize(("method", "path", "prefix"), ROUTES)
@pytest.mark.usefixtures("planted")
def test_an_id_not_of_the_store_shape_is_404_naming_id(
    stack: Stack, batch_id: str, method: str, path: str, prefix: str, shape: str
) -> None:
    response = stack.idle.request(method, path.format(shape.format(prefix=prefix)), headers=ACME)
    error = names_the_field(response, 404, "id")
    assert error["type"] == "not_found"
    still_usable(stack, batch_id, response)


# --- a Redis error that is the gateway's own ----------------------------------------------


def test_a_redis_error_not_caused_by_input_is_500_with_its_traceback_on_an_open_connection(
    stack: Stack, store: redis.Redis, batch_id: str
) -> None:
    """A well-formed batch id whose order list is a string (only a bug could write that):
    Redis refuses the page read. 500, not 503 "retry"; logged with the traceback; the
    connection still answers."""
    broken = BATCH_ID_PREFIX + uuid.uuid4().hex
    store.hset(BATCH_KEY + broken, mapping={"tenant": "acme", "index": INDEX, "total": "1",
                                             "created_at": "1.0"})  # fmt: skip
    store.set(BATCH_ORDER_KEY + broken, "not a list")
    try:
        response = results(stack, broken)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["type"] == "internal_error"
        assert "retry-after" not in response.headers
        still_usable(stack, batch_id, response)
    finally:
        store.delete(BATCH_KEY + broken, BATCH_ORDER_KEY + broken)
    log = stack.logs[2].read_text()  # the idle gateway's
    assert f"job store error on GET /v1/batches/{broken}/results" in log
    assert "WRONGTYPE" in log
