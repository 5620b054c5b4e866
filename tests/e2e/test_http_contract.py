"""The HTTP contract's edges: auth, a 4xx naming each bad field, size limits, OpenAPI, ops."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.conftest import ACME, IDLE_BODY_LIMIT, INDEX, Stack

SEARCH = {"index": INDEX, "query": "tea"}
BATCH = {"index": INDEX, "queries": [{"id": "a", "query": "tea"}]}


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}]
)
def test_missing_key_is_401(stack: Stack, headers: dict[str, str]) -> None:
    response = stack.live.post("/v1/searches", json=SEARCH, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "unauthenticated"
    assert response.headers["www-authenticate"] == "Bearer"


def test_bad_key_is_refused(stack: Stack) -> None:
    for path in ("/v1/searches/srch_x", "/v1/batches/bat_x"):
        response = stack.live.get(path, headers={"Authorization": "Bearer not-a-real-key"})
        assert response.status_code == 403, response.text  # a key, not known: 401 is for none
        error = response.json()["error"]
        assert (error["type"], error["field"]) == ("forbidden", "Authorization"), error
        assert "API key" in error["message"]


CASES: list[tuple[str, str, dict[str, Any], dict[str, Any], str]] = [
    ("POST", "/v1/searches", {**SEARCH, "index": "Bad Index!"}, {}, "index"),
    ("POST", "/v1/searches", {"query": "tea"}, {}, "index"),
    ("POST", "/v1/searches", {**SEARCH, "query": ""}, {}, "query"),
    ("POST", "/v1/searches", {**SEARCH, "query": "   "}, {}, "query"),
    ("POST", "/v1/searches", {**SEARCH, "query": "x" * 2001}, {}, "query"),
    # no visible character: a zero-width space, NUL, a soft hyphen, a BOM, a line separator
    *[
        ("POST", "/v1/searches", {**SEARCH, "query": q}, {}, "query")
        for q in ("\u200b", "\u0000", "\u00ad", "\ufeff", " \u2028\u200b\t\u3000")
    ],
    # no letter, digit or symbol: punctuation alone has no word for BM25 and means nothing
    # to the embedder (it searched and answered arbitrary hits)
    *[
        ("POST", "/v1/searches", {**SEARCH, "query": q}, {}, "query")
        for q in ("?!", "...", " ¿¡ — ", "。、", "___")
    ],
    ("POST", "/v1/searches", {**SEARCH, "limit": 0}, {}, "limit"),
    ("POST", "/v1/searches", {**SEARCH, "limit": 101}, {}, "limit"),
    ("POST", "/v1/searches", {**SEARCH, "limit": "ten"}, {}, "limit"),
    ("POST", "/v1/searches", {**SEARCH, "mode": "semantic"}, {}, "mode"),
    ("POST", "/v1/searches", {**SEARCH, "rerank": "maybe"}, {}, "rerank"),
    ("POST", "/v1/searches", {**SEARCH, "include_trace": "yes please"}, {}, "include_trace"),
    ("POST", "/v1/searches", {**SEARCH, "filters": {"a": [1, 2]}}, {}, "filters.a"),
    ("POST", "/v1/searches", {**SEARCH, "filters": "x"}, {}, "filters"),
    ("POST", "/v1/searches", {**SEARCH, "webhook_url": "ftp://example.com/x"}, {}, "webhook_url"),
    ("POST", "/v1/searches", {**SEARCH, "tenant": "evil"}, {}, "tenant"),
    ("POST", "/v1/searches", SEARCH, {"wait": 31}, "wait"),
    ("POST", "/v1/searches", SEARCH, {"wait": "soon"}, "wait"),
    ("POST", "/v1/batches", {**BATCH, "index": ""}, {}, "index"),
    ("POST", "/v1/batches", {**BATCH, "queries": []}, {}, "queries"),
    ("POST", "/v1/batches", {**BATCH, "queries": [{"id": "", "query": "x"}]}, {}, "queries[0].id"),
    ("POST", "/v1/batches", {**BATCH, "queries": [{"query": "x"}]}, {}, "queries[0].id"),
    (
        "POST",
        "/v1/batches",
        {**BATCH, "queries": [{"id": "a", "query": "x"}, {"id": "a", "query": "y"}]},
        {},
        "queries[1].id",
    ),
    (
        "POST",
        "/v1/batches",
        {**BATCH, "queries": [{"id": "a", "query": ""}]},
        {},
        "queries[0].query",
    ),
    (
        "POST",
        "/v1/batches",
        {**BATCH, "queries": [{"id": "a", "query": "tea"}, {"id": "b", "query": "\u200b\u00ad"}]},
        {},
        "queries[1].query",
    ),
    (
        "POST",
        "/v1/batches",
        {
            **BATCH,
            "queries": [
                *[{"id": f"q{n}", "query": "tea"} for n in range(3)],
                {"id": "d", "query": "?!"},
            ],
        },
        {},
        "queries[3].query",
    ),
    (
        "POST",
        "/v1/batches",
        {**BATCH, "queries": [{"id": "a", "query": "x", "limit": 0}]},
        {},
        "queries[0].limit",
    ),
    (
        "POST",
        "/v1/batches",
        {**BATCH, "queries": [{"id": "a", "query": "x", "mode": "z"}]},
        {},
        "queries[0].mode",
    ),
    ("POST", "/v1/batches", {**BATCH, "lane": "express"}, {}, "lane"),
    ("POST", "/v1/batches", {**BATCH, "rerank": "maybe"}, {}, "rerank"),
    ("POST", "/v1/batches", {**BATCH, "webhook_url": "not a url"}, {}, "webhook_url"),
    ("GET", "/v1/batches/bat_x/results", {}, {"page_size": 0}, "page_size"),
    ("GET", "/v1/batches/bat_x/results", {}, {"page_size": 100_000}, "page_size"),
    (
        "POST",
        "/v1/indexes/Bad%20Index/documents",
        {"documents": [{"id": "1", "text": "t"}]},
        {},
        "index",
    ),
    ("POST", "/v1/indexes/docs/documents", {"documents": []}, {}, "documents"),
    ("POST", "/v1/indexes/docs/documents", {"documents": [{"id": "1"}]}, {}, "documents[0].text"),
    # no visible character, as a query's blank: str.strip() let these through to be indexed
    *[
        (
            "POST",
            "/v1/indexes/docs/documents",
            {"documents": [{"id": "1", "text": "t"}, {"id": "2", "text": text}]},
            {},
            "documents[1].text",
        )
        for text in ("\u200b", "\u0000", "\u00ad", "\ufeff", " \u2028\u200b\t\u3000")
    ],
    (
        "POST",
        "/v1/indexes/docs/documents",
        {"documents": [{"id": "", "text": "t"}]},
        {},
        "documents[0].id",
    ),
    # a dot segment: every HTTP client resolves it, so DELETE .../documents/.. dropped the index
    *[
        (
            "POST",
            "/v1/indexes/docs/documents",
            {"documents": [{"id": "1", "text": "t"}, {"id": dots, "text": "t"}]},
            {},
            "documents[1].id",
        )
        for dots in (".", "..")
    ],
    # ... and so is one between slashes: DELETE .../documents/x/../.. sent raw (an id's "/"
    # may be) dropped the index, and .../documents/a/../b deleted document b
    *[
        (
            "POST",
            "/v1/indexes/docs/documents",
            {"documents": [{"id": "1", "text": "t"}, {"id": dots, "text": "t"}]},
            {},
            "documents[1].id",
        )
        for dots in ("x/../..", "a/../b", "./c", "a/.", "a/./b", "a//..")
    ],
    (
        "POST",
        "/v1/indexes/docs/documents",
        {"documents": [{"id": "1", "text": "t", "metadata": {"k": {"nested": 1}}}]},
        {},
        "documents[0].metadata.k",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "params", "field"),
    CASES,
    ids=[f"{c[1].split('/')[2]}:{c[4]}" for c in CASES],
)
def test_each_bad_field_is_named(
    stack: Stack, method: str, path: str, body: dict[str, Any], params: dict[str, Any], field: str
) -> None:
    kwargs: dict[str, Any] = {"params": params, "headers": ACME}
    if method == "POST":
        kwargs["json"] = body
    response = stack.live.request(method, path, **kwargs)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"].startswith(field + ":") or field in error["message"]


@pytest.mark.parametrize("query", ["\U0001f525", "$", "\u6771\u4eac", "\u00bd", "+", "?x"])
def test_a_query_of_one_symbol_digit_or_cjk_word_is_searched(
    stack: Stack, corpus: list[dict[str, object]], query: str
) -> None:
    """The refusal of punctuation alone keeps what can be searched: an emoji or a currency
    sign (symbols), a vulgar fraction (a number), a CJK word."""
    body = {**SEARCH, "query": query}
    response = stack.live.post("/v1/searches", params={"wait": 20}, json=body, headers=ACME)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded", response.text


def test_bad_page_token_is_named(stack: Stack) -> None:
    batch = stack.idle.post("/v1/batches", json=BATCH, headers=ACME).json()
    response = stack.idle.get(
        f"/v1/batches/{batch['id']}/results", params={"page_token": "garbage!"}, headers=ACME
    )
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "page_token"


def test_malformed_json_is_a_4xx(stack: Stack) -> None:
    response = stack.live.post(
        "/v1/searches",
        content=b'{"index": "docs", "query": ',
        headers={**ACME, "content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "body"
    response = stack.live.post(
        "/v1/searches", content=b"[1, 2]", headers={**ACME, "content-type": "application/json"}
    )
    assert 400 <= response.status_code < 500


def test_body_over_the_limit_is_413(stack: Stack) -> None:
    big = {"index": INDEX, "queries": [{"id": str(i), "query": "x" * 100} for i in range(2000)]}
    response = stack.idle.post("/v1/batches", json=big, headers=ACME)
    assert response.status_code == 413
    assert str(IDLE_BODY_LIMIT) in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/hook",
        "http://169.254.169.254/latest",
        "http://10.0.0.1/x",
        "http://localhost/x",
        "http://[::1]/x",
    ],
)
def test_ssrf_refused_at_registration(stack: Stack, url: str) -> None:
    for path, body in (("/v1/searches", SEARCH), ("/v1/batches", BATCH)):
        response = stack.idle.post(path, json={**body, "webhook_url": url}, headers=ACME)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == "webhook_url"
        # the refusal names the setting for a local receiver, but never for a metadata address
        named = "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS=true" in response.json()["error"]["message"]
        assert named == ("169.254.169.254" not in url), response.text


def test_unknown_ids_are_404(stack: Stack) -> None:
    for path in (
        "/v1/searches/srch_nope",
        "/v1/batches/bat_nope",
        "/v1/batches/bat_nope/results",
        "/v1/ingestions/ing_nope",
    ):
        response = stack.live.get(path, headers=ACME)
        assert response.status_code == 404, path
    assert stack.live.delete("/v1/batches/bat_nope", headers=ACME).status_code == 404


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/indexes/"),
        ("GET", f"/v1/indexes/{INDEX}/"),
        ("DELETE", f"/v1/indexes/{INDEX}/"),
        ("POST", "/v1/searches/"),
        ("GET", "/v1/batches/"),
    ],
)
def test_a_trailing_slash_is_404_naming_path(
    stack: Stack, corpus: object, method: str, path: str
) -> None:
    """A path with a slash too many is a path no route has. Starlette answered it with an
    empty ``307`` to the path without the slash, built from the request's ``Host`` header:
    no error body, and a client that follows redirects (307 keeps the method) sent
    ``DELETE /v1/indexes/docs/``, a typo, on as ``DELETE /v1/indexes/docs``, the index's drop."""
    kwargs: dict[str, Any] = {"headers": ACME}
    if method == "POST":
        kwargs["json"] = SEARCH
    response = stack.live.request(method, path, **kwargs)
    assert response.status_code == 404, (response.status_code, response.headers)
    assert "location" not in response.headers
    error = response.json()["error"]
    assert error["field"] == "path" and path in error["message"], error
    shown = stack.live.get(f"/v1/indexes/{INDEX}", headers=ACME)
    assert shown.status_code == 200 and shown.json()["documents"] > 0, shown.text


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/searches%0A", SEARCH),
        ("GET", f"/v1/indexes/{INDEX}/documents%0A", None),
        ("POST", "/v1/indexes/line-break/documents%0A", {"documents": [{"id": "d", "text": "t"}]}),
        ("POST", f"/v1/indexes/{INDEX}/documents/delete%0A", {"ids": ["not-there"]}),
        ("DELETE", "/v1/batches%0A", None),
        ("GET", "/healthz%0A", None),
    ],
)
def test_a_last_line_break_is_404_naming_path(
    stack: Stack, corpus: object, method: str, path: str, body: Any
) -> None:
    """Starlette's route regexes end in ``$``, which also matches before a last line break:
    ``POST /v1/searches%0A`` was a search, ``POST .../documents/delete%0A`` a delete and
    ``DELETE /v1/batches%0A`` a 405 of ``/v1/batches``. Such a path is one no route has, and
    its 404 lists no methods (the 405 it was made of said ``Allow: POST``)."""
    response = stack.live.request(method, path, json=body, headers=ACME)
    assert response.status_code == 404, (response.status_code, response.text)
    assert "allow" not in response.headers, response.headers
    error = response.json()["error"]
    assert error["field"] == "path", error
    assert repr(path.replace("%0A", "\n")) in error["message"], error
    assert stack.live.get("/v1/indexes/line-break", headers=ACME).status_code == 404


def test_a_document_id_ending_in_a_line_break_keeps_its_methods(stack: Stack) -> None:
    """A route ending in a parameter takes the line break into it: a document id ending in
    one is read, and a method its route lacks is still the 405 of that route."""
    base = "/v1/indexes/line-break-id/documents"
    doc = {"id": "d1\n", "text": "okapi stripes"}
    made = stack.live.post(base, params={"wait": 20}, json={"documents": [doc]}, headers=ACME)
    assert made.status_code == 200, made.text
    got = stack.live.get(base + "/d1%0A", headers=ACME)
    assert got.status_code == 200 and got.json()["id"] == "d1\n", got.text
    put = stack.live.put(base + "/d1%0A", json={}, headers=ACME)
    assert put.status_code == 405 and put.json()["error"]["field"] == "method", put.text
    assert put.headers["allow"] == "DELETE, GET, HEAD", put.headers


@pytest.mark.parametrize(
    "keys", [("acme-key-0001", "globex-key-0001"), ("globex-key-0001", "acme-key-0001")]
)
def test_two_authorization_headers_are_401_naming_it(
    stack: Stack, corpus: object, keys: tuple[str, str]
) -> None:
    """Two keys on one request: the first was used and the other ignored, so the tenant a
    request ran as depended on the order a client or a proxy put its headers in."""
    headers = [("Authorization", f"Bearer {key}") for key in keys]
    for method, path in (("GET", "/v1/indexes"), ("GET", f"/v1/indexes/{INDEX}")):
        response = stack.live.request(method, path, headers=headers)
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["field"] == "Authorization" and "2 times" in error["message"], error
    response = stack.live.post("/v1/searches", json=SEARCH, headers=headers)
    assert response.status_code == 401, response.text


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("OPTIONS", "/v1/batches/bat_0", "DELETE, GET, HEAD"),
        ("PUT", "/v1/batches/bat_0", "DELETE, GET, HEAD"),
        ("PUT", f"/v1/indexes/{INDEX}", "DELETE, GET, HEAD, PATCH"),
        ("PUT", f"/v1/indexes/{INDEX}/documents", "GET, HEAD, POST"),
        ("PUT", f"/v1/indexes/{INDEX}/documents/d1", "DELETE, GET, HEAD"),
        # the bulk delete's path is also document "delete"'s
        ("PUT", f"/v1/indexes/{INDEX}/documents/delete", "DELETE, GET, HEAD, POST"),
        ("PUT", "/v1/searches", "GET, HEAD, POST"),
        # a static file of the /docs page: no route's, its StaticFiles mount says (it was "")
        ("PUT", "/docs/assets/swagger-ui.css", "GET, HEAD"),
    ],
)
def test_a_405_allows_every_method_of_its_path(
    stack: Stack, method: str, path: str, allow: str
) -> None:
    """``Allow`` listed the methods of the first route of the path only (Starlette's: each
    method is a route of its own): ``GET`` for a batch that a ``DELETE`` cancels, ``GET`` for
    an index that ``PATCH`` and ``DELETE`` change too, and ``GET`` alone for the bulk delete's
    ``POST`` path."""
    response = stack.live.request(method, path, headers=ACME)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allow
    assert response.json()["error"]["field"] == "method"


def test_the_job_id_parameter_is_named_id(stack: Stack) -> None:
    """DESIGN.md §9 names a job's path parameter ``id`` (``/v1/searches/{id}``), as the 404s
    do; the OpenAPI document and a 422 named it ``job_id`` or ``batch_id``."""
    paths = stack.live.get("/openapi.json").json()["paths"]
    for template in (
        "/v1/searches/{id}",
        "/v1/batches/{id}",
        "/v1/batches/{id}/results",
        "/v1/ingestions/{id}",
    ):
        assert template in paths, sorted(paths)
        for operation in paths[template].values():
            assert [p["name"] for p in operation["parameters"] if p["in"] == "path"] == ["id"]
    for method, path in (
        ("GET", "/v1/searches/%FF"),
        ("HEAD", "/v1/searches/%FF"),
        ("GET", "/v1/batches/%FF"),
        ("GET", "/v1/batches/%FF/results"),
        ("DELETE", "/v1/batches/%FF"),
        ("GET", "/v1/ingestions/%FF"),
    ):
        bad = stack.live.request(method, path, headers=ACME)
        assert bad.status_code == 422, (method, path, bad.text)
        if method != "HEAD":
            assert bad.json()["error"]["field"] == "id", (method, path, bad.text)
    extra = stack.live.get("/v1/searches/srch_nope?colour=red", headers=ACME)
    assert extra.status_code == 422 and "GET /v1/searches/{id}" in extra.text, extra.text


def test_openapi_declares_the_contract(stack: Stack) -> None:
    doc = stack.live.get("/openapi.json").json()
    paths = doc["paths"]
    for path in (
        "/v1/searches",
        "/v1/searches/{id}",
        "/v1/batches",
        "/v1/batches/{id}",
        "/v1/batches/{id}/results",
        "/v1/indexes/{index}/documents",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    post = paths["/v1/searches"]["post"]
    assert "$ref" in str(post["responses"]["202"]) and "SearchJobOut" in str(post["responses"])
    assert "ErrorBody" in str(post["responses"]["422"])
    assert "BatchResultsPage" in str(paths["/v1/batches/{id}/results"]["get"])
    listed = paths["/v1/indexes/{index}/documents"]["get"]
    assert "DocumentsPage" in str(listed["responses"]["200"]) and "ErrorBody" in str(listed)
    assert {p["name"] for p in listed["parameters"]} >= {"index", "page_size", "page_token"}
    assert "vector" not in doc["components"]["schemas"]["ListedDocumentOut"]["properties"]
    # every page has the token, null on the last: a client reads it, never tests for it
    assert set(doc["components"]["schemas"]["DocumentsPage"]["required"]) == {
        "documents",
        "next_page_token",
    }
    assert "Idempotency-Key" in str(post["parameters"])
    schemas = doc["components"]["schemas"]
    assert set(schemas["BatchCounts"]["properties"]) == {
        "total",
        "queued",
        "running",
        "succeeded",
        "failed",
        "canceled",
    }


def test_health_ready_and_metrics(stack: Stack, corpus: object) -> None:
    assert stack.live.get("/healthz").json() == {"status": "ok"}
    assert stack.live.get("/readyz").json() == {"status": "ok"}
    # a search of its own: run alone (or first on its xdist worker), no other test made one
    body = {"index": INDEX, "query": "bees"}
    assert stack.live.post("/v1/searches", json=body, headers=ACME).status_code == 202
    text = stack.live.get("/metrics").text
    assert 'sift_jobs_in_flight{state="queued"}' in text
    assert 'sift_queue_backlog{queue="sift.batch"}' in text
    assert 'sift_http_requests_total{method="POST",route="/v1/searches",status="202"}' in text
    assert "sift_jobs_submitted_total" in text


def test_the_route_label_is_the_openapi_path(stack: Stack) -> None:
    """The document routes' label was their template with its convertor (``{id:doc_id}``),
    a path in no OpenAPI document: a dashboard or alert written from the API's paths missed
    them."""
    stack.live.get(f"/v1/indexes/{INDEX}/documents/nobody", headers=ACME)
    text = stack.live.get("/metrics").text
    label = 'route="/v1/indexes/{index}/documents/{id}"'
    assert f'sift_http_requests_total{{method="GET",{label},status="404"}}' in text
    assert "{id:" not in text


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_the_probes_answer_head(stack: Stack, path: str) -> None:
    """RFC 9110 (9.1): a server supports HEAD wherever it supports GET. The probes were 405
    to it, and an uptime monitor or load balancer checking with HEAD took the gateway for
    down."""
    response = stack.live.head(path)
    assert response.status_code == 200, response.headers
    assert response.content == b""
    assert "HEAD" in stack.live.request("PUT", path).headers["allow"]


UTF8_ROUTES = [
    ("POST", "/v1/searches", SEARCH),
    ("POST", "/v1/batches", BATCH),
    ("POST", f"/v1/indexes/{INDEX}/documents", {"documents": [{"id": "u1", "text": "tea"}]}),
    ("POST", f"/v1/indexes/{INDEX}/documents/delete", {"ids": ["u1"]}),
]


@pytest.mark.parametrize(("method", "path", "body"), UTF8_ROUTES)
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "latin-1"])
def test_a_body_that_is_not_utf8_is_400_naming_body(
    stack: Stack, method: str, path: str, body: dict[str, Any], encoding: str
) -> None:
    """RFC 8259: JSON between systems is UTF-8, and docs/queue.md says a body that is not is a
    400 naming ``body``; a UTF-16 or UTF-32 body was read all the same (``json.loads`` of
    bytes guesses the encoding). Latin-1 (a byte 0xe9) was refused, as it still is."""
    text = json.dumps({**body, "é": 1} if encoding == "latin-1" else body, ensure_ascii=False)
    response = stack.idle.request(
        method,
        path,
        content=text.encode(encoding),
        headers={**ACME, "Content-Type": "application/json"},
    )
    assert response.status_code == 400, (encoding, response.text)
    error = response.json()["error"]
    assert error["field"] == "body" and "UTF-8" in error["message"], error


@pytest.mark.parametrize(("method", "path", "body"), UTF8_ROUTES)
def test_a_utf8_body_after_a_byte_order_mark_is_read(
    stack: Stack, method: str, path: str, body: dict[str, Any]
) -> None:
    """RFC 8259 §8.1 lets a parser ignore a UTF-8 byte order mark; Sift does, as before."""
    response = stack.idle.request(
        method,
        path,
        content=b"\xef\xbb\xbf" + json.dumps(body).encode(),
        headers={**ACME, "Content-Type": "application/json"},
    )
    assert response.status_code == 202, response.text
