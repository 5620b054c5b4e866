"""Every ``202`` says where to poll (``Location``), and ``/docs`` needs nothing off the gateway.

The idle gateway's jobs stay queued (no worker consumes its database), so each submission
there is a ``202`` for sure.
"""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import urlsplit

import httpx

from tests.e2e.conftest import ACME, INDEX, Stack

SUBMISSIONS = [
    ("/v1/searches", {"index": INDEX, "query": "tea"}, "/v1/searches/"),
    ("/v1/batches", {"index": INDEX, "queries": [{"id": "a", "query": "tea"}]}, "/v1/batches/"),
    (
        f"/v1/indexes/{INDEX}/documents",
        {"documents": [{"id": "d1", "text": "green tea"}]},
        "/v1/ingestions/",
    ),
]


def test_each_202_has_a_location_that_answers_with_the_same_job(stack: Stack) -> None:
    for path, body, prefix in SUBMISSIONS:
        response = stack.idle.post(path, json=body, headers=ACME)
        assert response.status_code == 202, (path, response.text)
        job = response.json()
        location = response.headers["location"]
        assert location == prefix + job["id"], path
        polled = stack.idle.get(location, headers=ACME)
        assert polled.status_code == 200, (location, polled.text)
        assert polled.json()["id"] == job["id"]


def test_a_replayed_202_keeps_its_location(stack: Stack) -> None:
    headers = {**ACME, "Idempotency-Key": "loc-replay-1"}
    first = stack.idle.post("/v1/searches", json={"index": INDEX, "query": "x"}, headers=headers)
    again = stack.idle.post("/v1/searches", json={"index": INDEX, "query": "x"}, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.headers["location"] == first.headers["location"]


def test_a_job_final_within_wait_is_200_without_location(stack: Stack, corpus: object) -> None:
    response = stack.live.post(
        "/v1/searches",
        params={"wait": 10},
        json={"index": INDEX, "query": "tea", "mode": "fts"},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    assert "location" not in response.headers


def test_the_openapi_document_declares_the_location_header(stack: Stack) -> None:
    paths = stack.live.get("/openapi.json").json()["paths"]
    for path in ("/v1/searches", "/v1/batches", "/v1/indexes/{index}/documents"):
        accepted = paths[path]["post"]["responses"]["202"]
        assert "Location" in accepted["headers"], path


class _Links(HTMLParser):
    """Every URL a page makes the browser load: ``src`` and ``href`` attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def test_docs_loads_only_what_the_gateway_serves(stack: Stack) -> None:
    page = stack.live.get("/docs")
    assert page.status_code == 200
    links = _Links()
    links.feed(page.text)
    urls = [*links.urls, "/openapi.json"]
    assert "url: '/openapi.json'" in page.text
    assert any(url.endswith("swagger-ui-bundle.js") for url in urls)
    assert any(url.endswith("swagger-ui.css") for url in urls)
    assert "http://" not in page.text and "https://" not in page.text
    for url in urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), url
        response = httpx.get(stack.live_url + url, timeout=10)
        assert response.status_code == 200, url
        assert response.content, url
