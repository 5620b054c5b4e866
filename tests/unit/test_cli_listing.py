"""The listing commands' paging: short filtered pages are followed by their token up to the
limit, and ``--limit`` is sent as the page size (at most the gateway's maximum)."""

from __future__ import annotations

from typing import Any

import httpx

from worker.cli._http import Gateway
from worker.cli.listing import fetch_jobs
from worker.constants import MAX_PAGE_SIZE


def gateway_of(pages: list[dict[str, Any]], seen: list[dict[str, str]]) -> Gateway:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        return httpx.Response(200, json=pages[len(seen) - 1])

    return Gateway("http://gw", "key", transport=httpx.MockTransport(answer))


def test_short_filtered_pages_are_followed_to_the_limit() -> None:
    pages = [
        {"batches": [], "next_page_token": "t1"},  # the scan bound: nothing matched yet
        {"batches": [{"id": "b1"}], "next_page_token": "t2"},
        {"batches": [{"id": "b2"}, {"id": "b3"}], "next_page_token": "t3"},
    ]
    seen: list[dict[str, str]] = []
    jobs = fetch_jobs(gateway_of(pages, seen), "/v1/batches", "batches", "failed", 2)
    assert [j["id"] for j in jobs] == ["b1", "b2"]
    assert seen == [
        {"page_size": "2", "status": "failed"},
        {"page_size": "2", "status": "failed", "page_token": "t1"},
        {"page_size": "2", "status": "failed", "page_token": "t2"},
    ]


def test_the_list_ends_at_a_null_token_and_the_page_size_is_capped() -> None:
    pages = [{"searches": [{"id": "s1"}], "next_page_token": None}]
    seen: list[dict[str, str]] = []
    jobs = fetch_jobs(gateway_of(pages, seen), "/v1/searches", "searches", None, 5000)
    assert [j["id"] for j in jobs] == ["s1"]
    assert seen == [{"page_size": str(MAX_PAGE_SIZE)}]
