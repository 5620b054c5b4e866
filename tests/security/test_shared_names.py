"""Names two tenants both choose stay each tenant's own, over the real stack.

* An Idempotency-Key is the caller's: another tenant sending the same key, with another
  body, with the same body, or while the first tenant's request still holds it, makes its
  own job and is told nothing of the other's (no ``422`` reused, no ``409`` in progress, no
  replay of the other's job), on searches and on batches.
* A tenant name and an index name never run together into one storage name: tenants ``sep``
  and ``sep.x`` (``_``, ``-``, ``--``) with indexes ``x.i`` and ``i`` would be one name if a
  store joined them with the separator they hold. Each pair keeps its own documents, its
  own settings and its own listing, and the other tenant's name is a ``404``.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from api_gateway.schemas import SearchRequest
from tests.e2e.conftest import ACME, GLOBEX, Stack
from tests.security.conftest import SECURITY_KEYS, SEPARATORS
from worker.queue.jobstore import JobStore, fingerprint

INDEX = "shared-names"


def _key() -> str:
    return "idem-" + uuid.uuid4().hex


def _search(stack: Stack, who: dict[str, str], key: str, query: str) -> httpx.Response:
    body = {"index": INDEX, "query": query}
    return stack.idle.post("/v1/searches", json=body, headers={**who, "Idempotency-Key": key})


def _batch(stack: Stack, who: dict[str, str], key: str, query: str) -> httpx.Response:
    body = {"index": INDEX, "queries": [{"id": "q1", "query": query}]}
    return stack.idle.post("/v1/batches", json=body, headers={**who, "Idempotency-Key": key})


@pytest.mark.parametrize("send", [_search, _batch], ids=["search", "batch"])
def test_another_tenants_idempotency_key_is_not_the_callers(stack: Stack, send: Any) -> None:
    key = _key()
    theirs = send(stack, ACME, key, "acme asks this")
    assert theirs.status_code == 202, theirs.text
    # another body, then the very same body: each globex's own new job, not acme's
    other_body = send(stack, GLOBEX, key, "globex asks that")
    assert other_body.status_code == 202, other_body.text
    assert other_body.json()["id"] != theirs.json()["id"]
    same_body = send(stack, GLOBEX, _key(), "acme asks this")
    assert same_body.status_code == 202, same_body.text
    # and the key now names globex's job for globex: a replay of its own, its own mismatch
    again = send(stack, GLOBEX, key, "globex asks that")
    assert again.status_code == 202 and again.json()["id"] == other_body.json()["id"]
    mismatch = send(stack, GLOBEX, key, "acme asks this")
    assert mismatch.status_code == 422, mismatch.text
    assert mismatch.json()["error"]["type"] == "idempotency_key_reused"
    # acme's key still names acme's job
    replay = send(stack, ACME, key, "acme asks this")
    assert replay.status_code == 202 and replay.json()["id"] == theirs.json()["id"]


def test_a_key_another_tenants_request_still_holds_is_free_for_the_caller(stack: Stack) -> None:
    key = _key()
    body = {"index": INDEX, "query": "acme asks this"}
    fp = fingerprint(
        "POST /v1/searches", SearchRequest.model_validate(body).model_dump(mode="json")
    )
    store = JobStore.from_url(stack.redis_url + "/1")  # the idle gateway's database
    try:
        # acme's first request has claimed the key (as the gateway does) and not yet made its job
        assert store.claim_idempotency("acme", key, fp).outcome == "new"
    finally:
        store.close()
    held = _search(stack, ACME, key, "acme asks this")
    assert held.status_code == 409, held.text  # the control: the claim is acme's
    assert held.json()["error"]["type"] == "idempotency_key_in_progress"
    mine = _search(stack, GLOBEX, key, "acme asks this")
    assert mine.status_code == 202, mine.text


# --- tenant and index names that a separator would join into one ------------------------

SEPARATOR_KEYS = {k["tenant"]: {"Authorization": f"Bearer {k['key']}"} for k in SECURITY_KEYS[2:]}
# ("sep", "x<s>i") and ("sep<s>x", "i") spell the same "sep<s>x<s>i" joined by <s>
PAIRS = [("sep", f"x{s}i") for s in SEPARATORS] + [(f"sep{s}x", "i") for s in SEPARATORS]


def _marker(n: int) -> str:
    return f"zqpair{n}mark"


@pytest.fixture(scope="module")
def pairs(stack: Stack) -> list[tuple[str, str]]:
    """Each pair's one document ``d`` (its own marker word) and candidate limit (10 + n)."""
    for n, (tenant, index) in enumerate(PAIRS):
        who = SEPARATOR_KEYS[tenant]
        doc = {"id": "d", "text": f"{_marker(n)} of {tenant} in {index}"}
        written = stack.live.post(
            f"/v1/indexes/{index}/documents",
            params={"wait": 20},
            json={"documents": [doc]},
            headers=who,
        )
        assert written.status_code == 200 and written.json()["upserted"] == 1, written.text
        patched = stack.live.patch(
            f"/v1/indexes/{index}", json={"candidate_limit": 10 + n}, headers=who
        )
        assert patched.status_code == 200, patched.text
    return PAIRS


def test_tenant_and_index_names_never_run_together(
    stack: Stack, pairs: list[tuple[str, str]]
) -> None:
    for n, (tenant, index) in enumerate(pairs):
        who = SEPARATOR_KEYS[tenant]
        own = {i for t, i in pairs if t == tenant}
        listed = stack.live.get("/v1/indexes", headers=who).json()["indexes"]
        assert {i["name"]: i["documents"] for i in listed} == dict.fromkeys(own, 1), tenant
        shown = stack.live.get(f"/v1/indexes/{index}", headers=who).json()
        assert shown["settings"]["candidate_limit"] == 10 + n, (tenant, index)
        doc = stack.live.get(f"/v1/indexes/{index}/documents/d", headers=who).json()
        assert doc["text"] == f"{_marker(n)} of {tenant} in {index}", (tenant, index)
        for m in range(len(pairs)):  # every pair's marker: only its own is found
            found = stack.live.post(
                "/v1/searches",
                params={"wait": 20},
                json={"index": index, "query": _marker(m), "mode": "fts"},
                headers=who,
            ).json()
            assert found["status"] == "succeeded", found
            hits = [h["text"] for h in found["result"]["hits"]]
            assert hits == ([doc["text"]] if m == n else []), (tenant, index, m)
        for other in {i for _, i in pairs} - own:  # another tenant's name: as nobody's
            missing = stack.live.get(f"/v1/indexes/{other}", headers=who)
            assert missing.status_code == 404, (tenant, other)
            assert missing.json()["error"]["type"] == "index_not_found"
