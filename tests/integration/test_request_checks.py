"""What the gateway refuses that it used to take and misread: each a 4xx naming the field.

A query parameter a route does not take, or one it takes given twice, is a 422 naming it,
as an unknown body field is: never silently ignored. So is an ``Idempotency-Key`` header
given twice.

Before, ``GET /v1/searches?statu=failed`` (a typo) listed every search as if unfiltered,
``POST /v1/searches?wiat=10`` answered 202 at once instead of waiting, ``GET
/v1/searches/{id}?wait=5`` (a long poll the API does not have) answered at once, and
``?status=queued&status=failed`` silently kept the last. Through the gateway app on a real
Redis; no worker is needed, since each is refused before anything is stored or enqueued.
"""

from __future__ import annotations

import gzip
import json

import pytest
from starlette.testclient import TestClient

from api_gateway.app import create_app
from api_gateway.schemas import iso
from tests.integration.gateway_app import ACME, gateway_settings
from worker.queue.jobstore import JobStore

SEARCH = {"index": "docs", "query": "tea"}
QUERY = {"id": "a", "query": "tea"}
BATCH = {"index": "docs", "queries": [QUERY]}
JOB = "srch_" + "0" * 32


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("GET", "/v1/searches?statu=failed", "statu"),
        ("GET", "/v1/searches?=1", "query"),  # a parameter with no name
        ("GET", "/v1/batches?page_size=5&index=docs", "index"),
        ("GET", "/v1/ingestions?limit=5", "limit"),
        ("GET", "/v1/indexes?status=queued", "status"),
        ("GET", f"/v1/searches/{JOB}?wait=5", "wait"),
        ("POST", "/v1/searches?wiat=10", "wiat"),
        ("POST", "/v1/batches?wait=10", "wait"),
        ("GET", "/v1/searches?status=queued&status=failed", "status"),
        ("POST", "/v1/searches?wait=1&wait=2", "wait"),
    ],
)
def test_an_unknown_or_repeated_query_parameter_is_422_naming_it(
    client: TestClient, method: str, path: str, field: str
) -> None:
    body = (
        {"index": "docs", "queries": [{"id": "a", "query": "tea"}]} if "batches" in path else SEARCH
    )
    response = client.request(method, path, json=body if method == "POST" else None, headers=ACME)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"].startswith(f"{field}: "), error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []  # nothing stored


@pytest.mark.parametrize(("path", "body"), [("/v1/searches", SEARCH), ("/v1/batches", BATCH)])
@pytest.mark.parametrize("keys", [("key-a", "key-b"), ("key-a", "key-a")])
def test_a_repeated_idempotency_key_is_422_naming_it(
    client: TestClient, path: str, body: dict[str, object], keys: tuple[str, str]
) -> None:
    """Two ``Idempotency-Key`` lines on one request: one was used, the other ignored."""
    headers = [*ACME.items(), *(("Idempotency-Key", key) for key in keys)]
    response = client.post(path, json=body, headers=headers)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "Idempotency-Key", error
    assert error["message"] == "Idempotency-Key: is given 2 times: give it once", error
    assert client.get(path, headers=ACME).json()[path.rsplit("/", 1)[1]] == []  # nothing stored
    once = client.post(path, json=body, headers={**ACME, "Idempotency-Key": keys[0]})
    assert once.status_code == 202, once.text  # one is taken, as before


def test_the_parameters_a_route_takes_are_still_taken(client: TestClient) -> None:
    assert client.get("/v1/searches?status=failed&page_size=5", headers=ACME).status_code == 200
    assert client.post("/v1/searches?wait=0", json=SEARCH, headers=ACME).status_code == 202


def test_without_a_key_it_is_still_401(client: TestClient) -> None:
    assert client.get("/v1/searches?statu=failed").status_code == 401


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_wait_that_is_not_a_finite_number_says_so(client: TestClient, value: str) -> None:
    """``wait=nan`` was refused as "less than or equal to 30", which it is not about; it is
    refused as a number not written in digits, as ``.5`` and ``+5`` are
    (``tests/security/test_query_forms.py``)."""
    response = client.post(f"/v1/searches?wait={value}", json=SEARCH, headers=ACME)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["message"] == (
        "wait: Input should be a number written in the digits 0-9, with a decimal point "
        "between digits and an exponent (e, a sign or none, digits) at most (no other sign, "
        "space or underscore)"
    )


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/searches", {**SEARCH, "limit": True}, "limit"),
        ("/v1/searches", {**SEARCH, "limit": "5"}, "limit"),
        ("/v1/searches", {**SEARCH, "limit": 5.0}, "limit"),
        ("/v1/searches", {**SEARCH, "rerank": "yes"}, "rerank"),
        ("/v1/searches", {**SEARCH, "include_trace": 1}, "include_trace"),
        ("/v1/searches", {**SEARCH, "candidate_limit": True}, "candidate_limit"),
        ("/v1/searches", {**SEARCH, "fusion": {"rank_constant": "60"}}, "fusion.rank_constant"),
        ("/v1/batches", {**BATCH, "rerank": "no"}, "rerank"),
        (
            "/v1/batches",
            {**BATCH, "queries": [{"id": "a", "query": "t", "limit": True}]},
            "queries[0].limit",
        ),
    ],
)
def test_a_body_value_of_the_wrong_json_type_is_422_naming_it(
    client: TestClient, path: str, body: dict[str, object], field: str
) -> None:
    """A boolean, a string or a float where the API takes an integer (or a boolean) is a
    wrong type, not a value to convert: ``"limit": true`` ran a search of one hit,
    ``"rerank": "yes"`` reranked, ``"rerank": "no"`` did not."""
    response = client.post(path, json=body, headers=ACME)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"].startswith(f"{field}: "), error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []
    assert client.get("/v1/batches", headers=ACME).json()["batches"] == []


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_415_naming_content_encoding(
    client: TestClient, encoding: str
) -> None:
    """The gateway reads bodies as sent: a compressed one was a 400 "body: is not valid JSON:
    'utf-8' codec can't decode byte 0x8b", which did not say that compression was the cause."""
    body = gzip.compress(json.dumps(SEARCH).encode())
    headers = {**ACME, "content-type": "application/json", "content-encoding": encoding}
    response = client.post("/v1/searches", content=body, headers=headers)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["field"] == "Content-Encoding", error
    assert error["message"].startswith(f"Content-Encoding: {encoding!r} is not accepted"), error


def test_an_identity_content_encoding_is_read(client: TestClient) -> None:
    headers = {**ACME, "content-encoding": "identity"}
    assert client.post("/v1/searches", json=SEARCH, headers=headers).status_code == 202


LATIN1_SEARCH = '{"index": "docs", "query": "café Ã©"}'.encode("latin-1")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/searches", LATIN1_SEARCH),
        ("/v1/batches", json.dumps(BATCH).encode()),  # ASCII: it was read, whatever it said
        ("/v1/indexes/docs/documents", b'{"documents": [{"id": "d", "text": "\\u00e9"}]}'),
    ],
)
@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; charset=latin-1",
        "application/json; charset=ISO-8859-1",
        'application/json; charset="windows-1252"',
        "application/json;charset=utf-16",
        "text/plain; charset=latin-1",
    ],
)
def test_a_body_in_another_charset_than_utf8_is_415_naming_content_type(
    client: TestClient, path: str, body: bytes, content_type: str
) -> None:
    """JSON is UTF-8 (RFC 8259): a body declared in Latin-1 was read as UTF-8 anyway, a 400
    "can't decode byte 0xe9" for "é", and "Ã©" (valid UTF-8 bytes) silently became "é"."""
    response = client.post(path, content=body, headers={**ACME, "content-type": content_type})
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["type"] == "unsupported_media_type" and error["field"] == "Content-Type", error
    charset = content_type.split("charset=")[1].strip('"')
    assert error["message"].startswith(f"Content-Type: charset {charset!r} is not accepted"), error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []  # nothing stored
    assert client.get("/v1/batches", headers=ACME).json()["batches"] == []
    assert client.get("/v1/ingestions", headers=ACME).json()["ingestions"] == []


@pytest.mark.parametrize(
    ("content_types", "message"),
    [
        (["application/json", "text/csv"], "is given 2 times: give it once"),
        (
            ["application/json; charset=utf-8; charset=latin-1"],
            "its charset parameter is given twice: give it once",
        ),
    ],
)
def test_two_content_types_or_charsets_are_415_naming_it(
    client: TestClient, content_types: list[str], message: str
) -> None:
    """Which of two types or charsets the body is in would be a guess (both took the first)."""
    headers = [*ACME.items(), *(("content-type", value) for value in content_types)]
    response = client.post("/v1/searches", content=json.dumps(SEARCH).encode(), headers=headers)
    assert response.status_code == 415, response.text
    assert response.json()["error"]["message"] == f"Content-Type: {message}"
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; charset=utf-8",
        'application/json; charset="UTF-8"',
        "application/json;charset=UTF8",
        "APPLICATION/JSON",
        "application/vnd.sift+json; charset=utf-8",
    ],
)
def test_utf8_json_is_read_under_each_spelling(client: TestClient, content_type: str) -> None:
    body = '{"index": "docs", "query": "café"}'.encode()
    response = client.post(
        "/v1/searches", content=body, headers={**ACME, "content-type": content_type}
    )
    assert response.status_code == 202, response.text
    assert client.get("/v1/searches", headers=ACME).json()["searches"][0]["query"] == "café"


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; charset=us-ascii",
        "application/json; charset=US-ASCII",
        "application/json;charset=ascii",
    ],
)
def test_an_ascii_body_declared_us_ascii_is_read(client: TestClient, content_type: str) -> None:
    """US-ASCII is UTF-8's first 128 characters: an ASCII body reads the same as either, and
    JSON's escapes carry any text in it (``json.dumps`` writes them by default). It was 415
    "charset 'us-ascii' is not accepted", a valid request refused."""
    body = json.dumps({"index": "docs", "query": "café"}).encode("ascii")  # "caf\\u00e9"
    response = client.post(
        "/v1/searches", content=body, headers={**ACME, "content-type": content_type}
    )
    assert response.status_code == 202, response.text
    assert client.get("/v1/searches", headers=ACME).json()["searches"][0]["query"] == "café"


def test_a_body_declared_us_ascii_that_is_not_is_415_naming_content_type(
    client: TestClient,
) -> None:
    """A byte past 127 is no US-ASCII: which charset it is in would be a guess."""
    body = '{"index": "docs", "query": "café"}'.encode("latin-1")
    headers = {**ACME, "content-type": "application/json; charset=us-ascii"}
    response = client.post("/v1/searches", content=body, headers=headers)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["field"] == "Content-Type", error
    assert error["message"] == (
        "Content-Type: charset 'us-ascii' is not what the body is in (byte 0xe9 at 31): "
        "send the body as UTF-8 (charset=utf-8, or none)"
    ), error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/searches", {**SEARCH, "rerank": True}),
        ("/v1/batches", {**BATCH, "rerank": True}),
        ("/v1/batches", {**BATCH, "rerank": True, "lane": "economy"}),
    ],
)
def test_a_rerank_without_a_generation_model_is_422_naming_rerank(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    """This deployment has no ``SIFT_GENERATION_MODEL``: ``rerank: true`` was accepted (202),
    then failed in the worker (``invalid_request: rerank: ... no generation model``), a batch's
    every item. It is refused before anything is stored, naming the setting; rerank off or
    left out is accepted."""
    response = client.post(path, json=body, headers=ACME)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "rerank" and "SIFT_GENERATION_MODEL" in error["message"], error
    kind = path.rsplit("/", 1)[1]
    assert client.get(f"/v1/{kind}", headers=ACME).json()[kind] == []  # nothing stored
    for rerank in (False, None):
        asked = {k: v for k, v in body.items() if k != "rerank"}
        asked |= {} if rerank is None else {"rerank": rerank}
        assert client.post(path, json=asked, headers=ACME).status_code == 202


@pytest.mark.parametrize("path", ["/v1/searches", "/v1/batches"])
def test_a_webhook_url_with_a_delete_character_is_422_naming_webhook_url(
    client: TestClient, path: str
) -> None:
    """DEL (0x7f) is a control character as those below 0x20 are, which were refused: it was
    accepted (202), and every delivery of the job's webhook raised (httpx refuses a URL
    holding one, outside the errors a delivery classifies), so it was never sent nor
    settled. Refused before anything is stored; the same URL without it is accepted. The
    host is a public literal: nothing to look up."""
    body = SEARCH if path == "/v1/searches" else BATCH
    response = client.post(
        path, json={**body, "webhook_url": "http://93.184.216.34/ho\x7fok"}, headers=ACME
    )
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "webhook_url" and "control characters" in error["message"], error
    kind = path.rsplit("/", 1)[1]
    assert client.get(f"/v1/{kind}", headers=ACME).json()[kind] == []  # nothing stored
    fine = client.post(
        path, json={**body, "webhook_url": "http://93.184.216.34/hook"}, headers=ACME
    )
    assert fine.status_code == 202, fine.text


@pytest.mark.parametrize("path", ["/v1/searches", "/v1/batches"])
def test_a_webhook_url_on_port_0_is_422_naming_webhook_url(client: TestClient, path: str) -> None:
    """Port 0 is no port a receiver listens on: such a URL was accepted (202), and each of
    its webhook's 8 attempts failed to connect, a retry, so the client learned it only when
    the schedule was spent, some 27 hours later. Refused before anything is stored."""
    body = SEARCH if path == "/v1/searches" else BATCH
    response = client.post(
        path, json={**body, "webhook_url": "http://93.184.216.34:0/hook"}, headers=ACME
    )
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "webhook_url" and "port" in error["message"], error
    kind = path.rsplit("/", 1)[1]
    assert client.get(f"/v1/{kind}", headers=ACME).json()[kind] == []  # nothing stored


def test_a_rerank_with_a_generation_model_is_accepted(redis_url: str, store: JobStore) -> None:
    settings = gateway_settings(redis_url, generation_model="anthropic:claude-haiku-4-5")
    with TestClient(create_app(settings)) as client:
        for path, body in [("/v1/searches", SEARCH), ("/v1/batches", BATCH)]:
            response = client.post(path, json={**body, "rerank": True}, headers=ACME)
            assert response.status_code == 202, response.text


@pytest.mark.parametrize(
    ("method", "path", "body", "field", "times"),
    [
        ("POST", "/v1/searches", '{"index": "docs", "query": "a", "query": "b"}', "query", 2),
        (
            "POST",
            "/v1/searches",
            '{"index": "docs", "query": "a", "fusion": {"weights": {"knn": 1, "knn": 2}}}',
            "fusion.weights.knn",
            2,
        ),
        (
            "POST",
            "/v1/searches",
            '{"index": "docs", "query": "a", "filters": {"k": 1, "k": 1, "k": 2}}',
            "filters.k",
            3,
        ),
        (
            "POST",
            "/v1/batches",
            '{"index": "docs", "queries": [{"id": "a", "query": "t", "limit": 3, "limit": 50}]}',
            "queries[0].limit",
            2,
        ),
        (
            "POST",
            "/v1/batches",
            '{"index": "docs", "rerank": false, "queries": [{"id": "a", "query": "t"}],'
            ' "rerank": true}',
            "rerank",
            2,
        ),
        (
            "POST",
            "/v1/indexes/docs/documents",
            '{"documents": [{"id": "d", "text": "t", "metadata": {"a": 1, "a": 2}}]}',
            "documents[0].metadata.a",
            2,
        ),
        ("POST", "/v1/indexes/docs/documents/delete", '{"ids": ["a"], "ids": ["b"]}', "ids", 2),
        (
            "PATCH",
            "/v1/indexes/docs",
            '{"candidate_limit": 5, "candidate_limit": 50}',
            "candidate_limit",
            2,
        ),
        # a name that is a lone surrogate (valid JSON, no UTF-8), named as pydantic names it
        # (its three bytes as three U+FFFD): the field's own text could not be written in the
        # UTF-8 answer, a 500 (on POST /v1/batches, the connection reset)
        (
            "POST",
            "/v1/searches",
            '{"index": "docs", "query": "a", "\\ud800": 1, "\\ud800": 2}',
            "\ufffd" * 3,
            2,
        ),
        (
            "POST",
            "/v1/batches",
            '{"index": "docs", "queries": [{"id": "a", "query": "t",'
            ' "filters": {"\\udfff": 1, "\\udfff": 2}}]}',
            "queries[0].filters." + "\ufffd" * 3,
            2,
        ),
    ],
)
def test_a_body_member_given_twice_is_422_naming_it(
    client: TestClient, method: str, path: str, body: str, field: str, times: int
) -> None:
    """``json.loads`` keeps the last of a repeated member: ``{"query": "a", "query": "b"}``
    searched "b" and ``"limit": 3, "limit": 50`` fifty, whatever the client meant. At any
    depth, on every route that reads a body (the batch's own scanner too), after the key
    check (401 without a key)."""
    headers = {"content-type": "application/json"}
    response = client.request(method, path, content=body.encode(), headers={**ACME, **headers})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"] == f"{field}: is given {times} times: give it once", error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []  # nothing stored
    assert client.get("/v1/batches", headers=ACME).json()["batches"] == []
    assert client.get("/v1/ingestions", headers=ACME).json()["ingestions"] == []
    unkeyed = client.request(method, path, content=body.encode(), headers=headers)
    assert unkeyed.status_code == 401, unkeyed.text


LONG = "9" * 5_000  # an integer of more digits than Python's int() reads from text (4,300)


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/v1/searches", f'{{"index": "docs", "query": "a", "limit": {LONG}}}', "limit"),
        (
            "POST",
            "/v1/searches",
            f'{{"index": "docs", "query": "a", "filters": {{"k": -{LONG}}}}}',
            "filters.k",
        ),
        (
            "POST",
            "/v1/batches",
            f'{{"index": "docs", "queries": [{{"id": "a", "query": "t"}},'
            f' {{"id": "b", "query": "t", "limit": {LONG}}}]}}',
            "queries[1].limit",
        ),
        (
            "POST",
            "/v1/indexes/docs/documents",
            f'{{"documents": [{{"id": "d", "text": "t", "metadata": {{"n": {LONG}}}}}]}}',
            "documents[0].metadata.n",
        ),
        ("PATCH", "/v1/indexes/docs", f'{{"candidate_limit": {LONG}}}', "candidate_limit"),
    ],
)
def test_an_integer_too_long_to_read_is_422_naming_it(
    client: TestClient, method: str, path: str, body: str, field: str
) -> None:
    """An integer of more than 4,300 digits is valid JSON, but Python's JSON reader refuses
    to convert it: the answer was a ``400`` "body: is not valid JSON: Exceeds the limit (4300
    digits) for integer string conversion ... use sys.set_int_max_str_digits() to increase the
    limit", naming no field and telling the client to call a Python function. It is a
    ``422`` naming the member, as any other value past its field's bounds, after the key check,
    and nothing is stored."""
    headers = {"content-type": "application/json"}
    response = client.request(method, path, content=body.encode(), headers={**ACME, **headers})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"] == f"{field}: is an integer of 5000 digits, past any limit here", error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []  # nothing stored
    assert client.get("/v1/batches", headers=ACME).json()["batches"] == []
    assert client.get("/v1/ingestions", headers=ACME).json()["ingestions"] == []
    unkeyed = client.request(method, path, content=body.encode(), headers=headers)
    assert unkeyed.status_code == 401, unkeyed.text


DOC = "/v1/indexes/docs/documents"
BAD_NAME = "\ufffd" * 3  # a lone surrogate's three bytes, each a U+FFFD, as pydantic names it


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/v1/searches", '{"index": "docs", "query": "a", "\\ud800": 1}', BAD_NAME),
        (
            "POST",
            "/v1/searches",
            '{"index": "docs", "query": "a", "fusion": {"\\udfff": 1}}',
            f"fusion.{BAD_NAME}",
        ),
        (
            "POST",
            "/v1/batches",
            '{"index": "docs", "\\ud800": 1, "queries": [{"id": "a", "query": "t"}]}',
            BAD_NAME,
        ),
        (
            "POST",
            "/v1/batches",
            '{"index": "docs", "queries": [{"id": "a", "query": "t"}, '
            '{"id": "b", "query": "t", "\\ud800": 1}]}',
            f"queries[1].{BAD_NAME}",
        ),
        (
            "POST",
            DOC,
            '{"documents": [{"id": "a", "text": "t", "\\udbff": "x"}]}',
            f"documents[0].{BAD_NAME}",
        ),
        ("POST", f"{DOC}/delete", '{"ids": ["a"], "\\ud800": 1}', BAD_NAME),
        ("PATCH", "/v1/indexes/docs", '{"\\ud800": null}', BAD_NAME),
    ],
)
def test_a_member_whose_name_is_a_lone_surrogate_is_422_naming_it(
    client: TestClient, method: str, path: str, body: str, field: str
) -> None:
    """A member of an object whose name is a lone surrogate (``"\\ud800"``: valid JSON, no
    UTF-8) is no member of it, and is named as pydantic names a filter key so made (each of
    its three bytes a U+FFFD). It was a 422 naming the object that holds it, with pydantic's
    message for a string value: ``body: Input should be a valid string, unable to parse raw
    data as a unicode string`` for a search's own member, ``documents[0]: ...`` for a
    document's, which named no member and said the object should have been a string."""
    headers = {"content-type": "application/json"}
    response = client.request(method, path, content=body.encode(), headers={**ACME, **headers})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    problem = "is not valid Unicode: its name holds a lone surrogate at character 0"
    assert error["message"] == f"{field}: {problem}", error
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == []  # nothing stored
    assert client.get("/v1/batches", headers=ACME).json()["batches"] == []
    assert client.get("/v1/ingestions", headers=ACME).json()["ingestions"] == []


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("GET", "/v1/indexes/x%C0", "index"),  # percent-escapes that are no UTF-8
        ("PATCH", "/v1/indexes/%FFx", "index"),
        ("DELETE", f"{DOC}/%C0", "id"),
        ("GET", f"{DOC}/a%E2", "id"),
        ("POST", "/v1/indexes/%C0/documents", "index"),
        ("GET", "/v1/indexes/bad%2Fname", "index"),  # not an index name
        ("DELETE", "/v1/indexes/bad%20name", "index"),
        ("POST", "/v1/indexes/bad%20name/documents/delete", "index"),
        ("GET", "/v1/indexes/" + "a" * 200, "index"),
    ],
)
def test_a_malformed_path_parameter_is_401_or_403_before_422(
    client: TestClient, method: str, path: str, field: str
) -> None:
    """The key is checked first, whatever else the request holds: a caller without a key
    (or with a wrong one) is told so, not which of its path parameters is malformed. A path
    whose percent-escapes were not UTF-8 was a 422 before the key was looked at."""
    body = {"ids": ["a"]} if path.endswith("/delete") else {}
    if method == "POST" and path.endswith("/documents"):
        body = {"documents": [{"id": "d", "text": "t"}]}
    sent = body if method in ("POST", "PATCH") else None
    unkeyed = client.request(method, path, json=sent)
    assert unkeyed.status_code == 401, unkeyed.text
    assert unkeyed.json()["error"]["field"] == "Authorization"
    wrong = client.request(method, path, json=sent, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403, wrong.text
    keyed = client.request(method, path, json=sent, headers=ACME)
    assert keyed.status_code == 422, keyed.text
    assert keyed.json()["error"]["field"] == field, keyed.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/searches"),
        ("POST", "/v1/batches"),
        ("POST", "/v1/indexes/docs/documents"),
        ("POST", "/v1/indexes/docs/documents/delete"),
        ("PATCH", "/v1/indexes/docs"),
    ],
)
@pytest.mark.parametrize(
    "raw",
    [b"{nope", b'{"index": "docs",}', b"\xff\xfe{}", b'{"ids": ' + b"[" * 100_000 + b"]" * 100_000],
)
def test_a_body_that_is_not_json_is_401_without_a_key_then_400(
    client: TestClient, method: str, path: str, raw: bytes
) -> None:
    """FastAPI reads a declared body before any dependency runs: a caller without a key got
    the 400 "body: is not valid JSON" (every route but the batch's, which reads its own),
    not the 401. The key comes first, whatever the request holds."""
    headers = {"content-type": "application/json"}
    unkeyed = client.request(method, path, content=raw, headers=headers)
    assert unkeyed.status_code == 401, unkeyed.text
    keyed = client.request(method, path, content=raw, headers={**ACME, **headers})
    assert keyed.status_code == 400, keyed.text
    error = keyed.json()["error"]
    assert error["field"] == "body" and error["message"].startswith("body: is not valid JSON"), (
        error
    )


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/searches", {**SEARCH, "limit": 0}),  # pydantic's
        ("POST", "/v1/searches?wiat=1", SEARCH),  # the gateway's own checks from here
        ("GET", "/v1/searches?page_token=bm90LW91cnM", None),
        ("POST", "/v1/indexes/docs/documents", {"documents": [{"id": "a", "text": " "}]}),
        ("POST", "/v1/batches", {"index": "docs", "queries": [QUERY, QUERY]}),
    ],
)
def test_each_problem_of_a_422_names_its_field_once(
    client: TestClient, method: str, path: str, body: dict[str, object] | None
) -> None:
    """A 422's ``fields`` lists each problem as ``{"field", "message"}``, the message without
    the field's name (the top ``message`` is ``field: message``). The gateway's own checks
    gave the name twice there (``{"field": "page_token", "message": "page_token: is not a
    token this list issued"}``), pydantic's once: a client printing ``field: message`` for
    each problem printed their name twice."""
    response = client.request(method, path, json=body, headers=ACME)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    (problem,) = error["fields"]
    assert problem["field"] == error["field"]
    assert not problem["message"].startswith(f"{problem['field']}:"), problem
    assert error["message"] == f"{problem['field']}: {problem['message']}", error


@pytest.mark.parametrize(
    ("method", "path", "sent"),
    [
        ("POST", "/v1%2Fsearches", "/v1%2Fsearches"),
        ("POST", "/v1/indexes/docs/documents%2fdelete", "/v1/indexes/docs/documents%2fdelete"),
    ],
)
def test_a_path_no_route_has_for_its_encoded_slash_is_quoted_as_sent(
    client: TestClient, method: str, path: str, sent: str
) -> None:
    """A ``%2F`` is a character of its segment, never a route's ``/``, so such a path is a
    ``404``; its message quoted the path decoded, ``no route '/v1/searches'``, a route there is,
    and never said why. Now it quotes the path as sent and says what the ``%2F`` is."""
    response = client.request(method, path, json={"ids": ["a"]}, headers=ACME)
    assert response.status_code == 404, response.text
    message = response.json()["error"]["message"]
    assert f"no route {sent!r}" in message and "%2F" in message, message


def test_an_ingest_job_shows_when_a_worker_started_it(client: TestClient, store: JobStore) -> None:
    """An ingest's ``GET`` and its list entry show ``started_at`` (as a search's do), so its
    queue wait and its run (the embedding and the write) are told apart: the record kept it,
    and neither showed it, so a slow ingest could have waited or worked."""
    body = {"documents": [{"id": "a", "text": "tea"}]}
    job = client.post("/v1/indexes/docs/documents", json=body, headers=ACME).json()
    assert job["started_at"] is None
    store.start_ingest(job["id"])
    started = store.get_ingest(job["id"])
    assert started is not None and started.started_at is not None
    shown = client.get(f"/v1/ingestions/{job['id']}", headers=ACME).json()
    assert shown["started_at"] == iso(started.started_at), shown
    (listed,) = client.get("/v1/ingestions", headers=ACME).json()["ingestions"]
    assert listed["started_at"] == shown["started_at"]


@pytest.mark.parametrize(("path", "body"), [("/v1/searches", SEARCH), ("/v1/batches", BATCH)])
def test_a_json_subtype_is_read_as_json_on_every_route(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    """FastAPI reads ``application/*+json`` as JSON; ``POST /v1/batches``, which reads its
    body itself, does the same (and refuses what FastAPI does not: test_stored_inputs.py)."""
    headers = {**ACME, "content-type": "application/merge-patch+json"}
    assert client.post(path, content=json.dumps(body).encode(), headers=headers).status_code == 202


def compact(error: dict[str, object]) -> bytes:
    """An error body as the gateway's other 4xx are written: no space, each key in order."""
    return json.dumps({"error": error}, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("headers", "body", "status", "field", "problem"),
    [
        (
            {"content-encoding": "gzip"},
            gzip.compress(json.dumps(SEARCH).encode()),
            415,
            "Content-Encoding",
            "'gzip' is not accepted: send the body uncompressed",
        ),
        (
            {"content-type": "application/json; charset=latin-1"},
            json.dumps(SEARCH).encode(),
            415,
            "Content-Type",
            "charset 'latin-1' is not accepted: send the body as UTF-8 (charset=utf-8, or none)",
        ),
        ({}, b"x" * 1025, 413, "body", "larger than the limit of 1024 bytes"),
    ],
    ids=["compressed", "charset", "too large"],
)
def test_a_body_refused_before_it_is_read_has_every_4xxs_shape(
    redis_url: str,
    store: JobStore,
    headers: dict[str, str],
    body: bytes,
    status: int,
    field: str,
    problem: str,
) -> None:
    """The middleware wrote its own bodies: no ``fields``, and spaces after each ``:`` and
    ``,``, where every other 4xx (a body sent as a form's, here) is compact with ``fields``."""
    settings = gateway_settings(redis_url, max_body_bytes=1024)
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/searches", content=body, headers={**ACME, **headers})
        form = client.post("/v1/searches", content=b"a=b", headers={**ACME, "content-type": "x/y"})
    assert response.status_code == status, response.text
    assert response.content == compact(
        {
            "type": "payload_too_large" if status == 413 else "unsupported_media_type",
            "message": f"{field}: {problem}",
            "field": field,
            "fields": [{"field": field, "message": problem}],
        }
    )
    assert form.status_code == 415 and form.content == compact(form.json()["error"]), form.text
    assert "fields" in form.json()["error"], form.text
