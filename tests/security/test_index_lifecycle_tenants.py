"""The index lifecycle is the caller's tenant's, over the real stack: acme and globex hold
indexes of the same names with documents of the same ids (and different texts). Each lists,
reads and deletes only its own; another tenant's index or document answers exactly like one
nobody has (same status and error body, name aside), and a delete of it deletes nothing.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import ACME, GLOBEX, Stack
from tests.security.test_index_privacy import same_shape

SHARED = "tenancy-shared"
ACME_ONLY = "tenancy-acme-only"
NOBODY = "tenancy-nobody"
IDS = ["d1", "d2"]


def _ingest(stack: Stack, index: str, who: dict[str, str], words: str) -> None:
    docs = [{"id": i, "text": f"{words} {i}", "title": words} for i in IDS]
    response = stack.live.post(
        f"/v1/indexes/{index}/documents", params={"wait": 20}, json={"documents": docs}, headers=who
    )
    assert response.status_code == 200 and response.json()["upserted"] == 2, response.text


def _names(stack: Stack, who: dict[str, str]) -> dict[str, int]:
    body = stack.live.get("/v1/indexes", headers=who).json()
    return {i["name"]: i["documents"] for i in body["indexes"]}


def _answer(stack: Stack, method: str, path: str, who: dict[str, str]) -> tuple[int, Any]:
    response = stack.live.request(method, path, headers=who)
    return response.status_code, response.json()


def test_two_tenants_same_names_and_ids(stack: Stack) -> None:
    _ingest(stack, SHARED, ACME, "acme apples")
    _ingest(stack, ACME_ONLY, ACME, "acme pears")
    _ingest(stack, SHARED, GLOBEX, "globex gears")

    acme, globex = _names(stack, ACME), _names(stack, GLOBEX)
    assert acme[SHARED] == 2 and acme[ACME_ONLY] == 2
    assert globex[SHARED] == 2 and ACME_ONLY not in globex

    doc = stack.live.get(f"/v1/indexes/{SHARED}/documents/d1", headers=GLOBEX).json()
    assert doc["text"] == "globex gears d1"

    # another tenant's index and document read like nobody's: the index is what is missing
    # (a document read said "not_found" naming the id, the index and its list "index")
    for theirs, nobodys in (
        (f"/v1/indexes/{ACME_ONLY}", f"/v1/indexes/{NOBODY}"),
        (f"/v1/indexes/{ACME_ONLY}/documents", f"/v1/indexes/{NOBODY}/documents"),
        (f"/v1/indexes/{ACME_ONLY}/documents/d1", f"/v1/indexes/{NOBODY}/documents/d1"),
    ):
        a = _answer(stack, "GET", theirs, GLOBEX)
        b = _answer(stack, "GET", nobodys, GLOBEX)
        assert a[0] == b[0] == 404
        assert same_shape(a[1], ACME_ONLY) == same_shape(b[1], NOBODY)
        assert (a[1]["error"]["type"], a[1]["error"]["field"]) == ("index_not_found", "index")
    # a document the caller's index lacks is the document's 404
    status, missing = _answer(stack, "GET", f"/v1/indexes/{SHARED}/documents/d9", GLOBEX)
    assert status == 404 and missing["error"]["field"] == "id", missing
    assert missing["error"]["type"] == "not_found", missing

    # globex deleting acme's index and documents: the same job answers, nothing of acme's goes
    for theirs, nobodys in (
        (f"/v1/indexes/{ACME_ONLY}", f"/v1/indexes/{NOBODY}"),
        (f"/v1/indexes/{ACME_ONLY}/documents/d1", f"/v1/indexes/{NOBODY}/documents/d1"),
    ):
        a = _answer(stack, "DELETE", theirs + "?wait=20", GLOBEX)
        b = _answer(stack, "DELETE", nobodys + "?wait=20", GLOBEX)
        assert a[0] == b[0] == 200
        assert a[1]["deleted"] == b[1]["deleted"] == 0
        assert same_shape(a[1], ACME_ONLY) == same_shape(b[1], NOBODY)
    assert _names(stack, ACME)[ACME_ONLY] == 2

    # a job id is the tenant's too: acme cannot read globex's delete job
    job = stack.live.delete(f"/v1/indexes/{SHARED}/documents/d2?wait=20", headers=GLOBEX).json()
    assert job["deleted"] == 1
    assert stack.live.get(f"/v1/ingestions/{job['id']}", headers=ACME).status_code == 404
    assert _names(stack, ACME)[SHARED] == 2 and _names(stack, GLOBEX)[SHARED] == 1
    acme_d2 = stack.live.get(f"/v1/indexes/{SHARED}/documents/d2", headers=ACME)
    assert acme_d2.status_code == 200 and acme_d2.json()["text"] == "acme apples d2"

    # globex drops its shared index: acme's part of the same name stays, searchable
    drop = stack.live.delete(f"/v1/indexes/{SHARED}?wait=20", headers=GLOBEX).json()
    assert drop["deleted"] == 1
    assert SHARED not in _names(stack, GLOBEX) and _names(stack, ACME)[SHARED] == 2
    search = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": SHARED, "query": "apples", "mode": "fts"},
        headers=ACME,
    ).json()
    assert {h["id"] for h in search["result"]["hits"]} == set(IDS)
