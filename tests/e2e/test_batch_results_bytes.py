"""A batch's results page is bounded by the stored size of its items as well as by their count:
items of long hits (documents of ~99,000 characters, inside the API's limits) made a page of
hundreds of MB, built whole in the gateway's memory (948 MB at the default ``page_size``)."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.conftest import ACME, Stack, finished_batch, ingest
from worker.constants import DEFAULT_PAGE_SIZE, MAX_RESULTS_PAGE_BYTES

LONG_INDEX = "longhits"
# each hit carries its document's whole text: ~99 kB a hit, so 90 hits are past the budget
# alone, 30 hits about three eighths of it
TEXT = ("chess kasparov opening " + "x" * 100 + " ") * 800
LIMITS = [90, 30, 30, 30, 90, 5, 30, 30]
SLACK = 0.01  # the test measures re-serialised JSON; the gateway, the stored bytes


def _stored_size(item: dict[str, Any]) -> int:
    """About the bytes Redis holds for the item's outcome (``{"result"}`` or ``{"error"}``)."""
    outcome = {k: item[k] for k in ("result", "error") if k in item}
    return len(json.dumps(outcome, separators=(",", ":")))


def test_a_results_page_ends_at_the_byte_budget_and_its_token_goes_on_from_there(
    stack: Stack,
) -> None:
    docs = [{"id": f"long{i:02d}", "text": TEXT} for i in range(max(LIMITS))]
    for start in range(0, len(docs), 30):
        ingest(stack, LONG_INDEX, docs[start : start + 30])
    queries = [
        {"id": f"q{i}", "query": f"chess kasparov {i}", "limit": limit}
        for i, limit in enumerate(LIMITS)
    ]
    batch, first = finished_batch(
        stack.live, {"index": LONG_INDEX, "queries": queries, "rerank": False}
    )
    assert batch["status"] == "succeeded", batch
    pages = [first["results"]]  # at the default page_size, as every later page
    token = first["next_page_token"]
    while token is not None:
        response = stack.live.get(
            f"/v1/batches/{batch['id']}/results", params={"page_token": token}, headers=ACME
        )
        assert response.status_code == 200, response.text
        pages.append(response.json()["results"])
        token = response.json()["next_page_token"]

    # every item once, in submission order, across the pages
    assert [r["query_id"] for page in pages for r in page] == [q["id"] for q in queries]
    sizes = [[_stored_size(r) for r in page] for page in pages]
    flat = [size for page in sizes for size in page]
    limits = {q["id"]: q["limit"] for q in queries}  # each item holds the hits it asked for
    assert all(len(r["result"]["hits"]) == limits[r["query_id"]] for page in pages for r in page)
    budget = MAX_RESULTS_PAGE_BYTES
    seen = 0
    for page, page_sizes in zip(pages, sizes, strict=True):
        assert 1 <= len(page) <= DEFAULT_PAGE_SIZE
        if len(page) > 1:  # more than one item only within the budget
            assert sum(page_sizes) <= budget * (1 + SLACK), page_sizes
        seen += len(page)
        if seen < len(flat):  # a page that ended early ended because the next was past it
            assert sum(page_sizes) + flat[seen] > budget * (1 - SLACK), (page_sizes, flat[seen])
    # the cases the bound has: an item past the budget alone on its page, and a page of
    # several items ended before page_size with more to come
    assert any(len(s) == 1 and s[0] > budget for s in sizes), sizes
    assert any(1 < len(s) < DEFAULT_PAGE_SIZE for s in sizes[:-1]), sizes
