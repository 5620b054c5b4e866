"""The job lists are the caller's own (issue 13), over the real stack.

Acme and globex each submit searches, batches and ingests, into the same index name with the
same query ids; each tenant's ``GET /v1/searches``, ``/v1/batches`` and ``/v1/ingestions``
(every page, every status filter) lists its own jobs and none of the other's, a page token
one tenant was issued reads only the other's own list when the other sends it, and a list
entry carries nothing of the other tenant's (ids, queries, index data).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ACME, GLOBEX, Stack

INDEX = "shared-name"
KINDS = (("/v1/searches", "searches"), ("/v1/batches", "batches"), ("/v1/ingestions", "ingestions"))
STATUSES = (None, "queued", "running", "succeeded", "failed", "canceled")


def _submit(client: httpx.Client, headers: dict[str, str], word: str) -> set[str]:
    """Two searches, a batch and an ingest of ``headers``' tenant; their ids."""
    ids = set()
    for i in range(2):
        body = {"index": INDEX, "query": f"{word} query {i}"}
        ids.add(client.post("/v1/searches", json=body, headers=headers).json()["id"])
    batch = {"index": INDEX, "queries": [{"id": "same-id", "query": f"{word} batch"}]}
    ids.add(client.post("/v1/batches", json=batch, headers=headers).json()["id"])
    documents = {"documents": [{"id": "same-doc", "text": f"{word} document"}]}
    response = client.post(f"/v1/indexes/{INDEX}/documents", json=documents, headers=headers)
    ids.add(response.json()["id"])
    return ids


def _listed(
    client: httpx.Client, headers: dict[str, str], path: str, key: str, **params: Any
) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    params = {"page_size": 1, **params}
    while True:
        response = client.get(path, params=params, headers=headers)
        assert response.status_code == 200, response.text
        jobs += response.json()[key]
        token = response.json()["next_page_token"]
        if token is None:
            return jobs
        params["page_token"] = token


@pytest.mark.parametrize("status", STATUSES)
def test_each_tenant_lists_only_its_own_jobs(stack: Stack, status: str | None) -> None:
    acme, globex = _submit(stack.live, ACME, "acmeword"), _submit(stack.live, GLOBEX, "globexword")
    filters = {} if status is None else {"status": status}
    seen: dict[str, set[str]] = {"acme": set(), "globex": set()}
    for tenant, headers, word in (("acme", ACME, "globexword"), ("globex", GLOBEX, "acmeword")):
        for path, key in KINDS:
            jobs = _listed(stack.live, headers, path, key, **filters)
            seen[tenant] |= {job["id"] for job in jobs}
            assert word not in str(jobs)  # nothing of the other tenant's, not even a query
            if status is not None:
                assert {job["status"] for job in jobs} <= {status}
    assert not seen["acme"] & globex and not seen["globex"] & acme
    if status is None:
        assert acme <= seen["acme"] and globex <= seen["globex"]


def test_a_page_token_reads_only_the_senders_own_list(stack: Stack) -> None:
    _submit(stack.live, ACME, "acmeword")
    theirs = _submit(stack.live, GLOBEX, "globexword")
    for path, key in KINDS:
        first = stack.live.get(path, params={"page_size": 1}, headers=GLOBEX).json()
        token = first["next_page_token"]
        assert token is not None
        # acme sends globex's cursor: it is only a place in time, read in acme's own list
        jobs = _listed(stack.live, ACME, path, key, page_token=token)
        assert not {job["id"] for job in jobs} & theirs
        assert "globexword" not in str(jobs)
