"""The job lists are the caller's own (issue 13), over the real stack.

Acme and globex each submit searches, batches and ingests, into the same index name with the
same query ids; each tenant's ``GET /v1/searches``, ``/v1/batches`` and ``/v1/ingestions``
(every page, every status filter) lists its own jobs and none of the other's, a page token
one tenant was issued is refused when the other sends it (a ``422`` naming ``page_token``, word
for word the document listing's), and a list entry carries nothing of the other tenant's
(ids, queries, index data).
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ACME, GLOBEX, Stack
from tests.security.test_limits import names_the_field

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


def _first_token(stack: Stack, headers: dict[str, str], path: str) -> str:
    first = stack.live.get(path, params={"page_size": 1}, headers=headers)
    assert first.status_code == 200, first.text
    token = first.json()["next_page_token"]
    assert token is not None
    return str(token)


def _foreign_document_token(stack: Stack) -> httpx.Response:
    """The document listing's answer to globex's token sent by acme: the answer to match."""
    documents = {"documents": [{"id": f"d{i}", "text": "globexword"} for i in range(2)]}
    path = f"/v1/indexes/{INDEX}/documents"
    created = stack.live.post(path, params={"wait": 20}, json=documents, headers=GLOBEX)
    assert created.status_code == 200, created.text
    token = _first_token(stack, GLOBEX, path)
    return stack.live.get(path, params={"page_token": token}, headers=ACME)


def test_another_tenants_page_token_is_refused_as_the_document_listing_refuses_it(
    stack: Stack,
) -> None:
    """Acme sending globex's token got a 200 that started acme's own list at globex's place:
    now the 422 a document listing answers another tenant's token, body for body."""
    _submit(stack.live, ACME, "acmeword")
    _submit(stack.live, GLOBEX, "globexword")
    expected = _foreign_document_token(stack)
    names_the_field(expected, 422, "page_token")
    for path, key in KINDS:
        token = _first_token(stack, GLOBEX, path)
        for status in (None, "succeeded"):  # the token is a place in the list, any filter's
            filters = {} if status is None else {"status": status}
            stolen = stack.live.get(path, params={"page_token": token, **filters}, headers=ACME)
            assert (stolen.status_code, stolen.json()) == (422, expected.json()), path
            # globex's own token still reads globex's next page
            own = stack.live.get(path, params={"page_token": token, **filters}, headers=GLOBEX)
            assert own.status_code == 200, own.text
            assert "acmeword" not in str(own.json()[key])


def test_a_page_token_of_another_list_is_refused(stack: Stack) -> None:
    """A token of the searches list is no token of the batches or ingestions list."""
    _submit(stack.live, ACME, "acmeword")
    _submit(stack.live, ACME, "acmeword")
    for path, _ in KINDS:
        token = _first_token(stack, ACME, path)
        for other, _ in KINDS:
            if other != path:
                response = stack.live.get(other, params={"page_token": token}, headers=ACME)
                names_the_field(response, 422, "page_token")


def test_a_cursor_without_a_digest_as_the_lists_issued_before_is_refused(stack: Stack) -> None:
    """Before the digest, a token was ``c:<time>:<id>`` in URL-safe base64, which any tenant's
    list took; such a token is refused now (a client starts again from the first page)."""
    mine = _submit(stack.live, ACME, "acmeword")
    job_id = sorted(i for i in mine if i.startswith("srch_"))[0]
    old = base64.urlsafe_b64encode(f"c:1764000000.5:{job_id}".encode()).decode().rstrip("=")
    response = stack.live.get("/v1/searches", params={"page_token": old}, headers=ACME)
    error = names_the_field(response, 422, "page_token")
    assert error["message"] == "page_token: is not a token this list issued"
