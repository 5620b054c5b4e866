"""``GET /v1/indexes/{index}/documents`` over the real stack (gateway, Redis, a Celery worker
on the embedded backend): the caller's documents by id, a page at a time, with strict page
tokens; deleted documents gone once their job finished; two tenants of the same index names
and ids each seeing only their own, and another tenant's index answering like nobody's."""

from __future__ import annotations

import base64
import json
from typing import Any

from tests.e2e.conftest import ACME, GLOBEX, Stack, ingest
from tests.security.test_index_privacy import same_shape
from worker.constants import DEFAULT_PAGE_SIZE, MAX_LIST_READ_BYTES, MAX_METADATA_VALUE_BYTES

IDS = ["a1", "a2", "b1", "B2", "c 1", "c/2", "d1", "é1"]  # code point order: B2 first


def _docs(ids: list[str], words: str) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "title": f"{words} {i}",
            "text": f"{words} {i} " + "x" * 300,
            "metadata": {"n": n},
        }
        for n, i in enumerate(ids)
    ]


def _page(stack: Stack, index: str, who: dict[str, str] = ACME, **params: Any) -> dict[str, Any]:
    response = stack.live.get(f"/v1/indexes/{index}/documents", params=params, headers=who)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _all_pages(
    stack: Stack, index: str, page_size: int, who: dict[str, str] = ACME
) -> list[list[dict[str, Any]]]:
    pages: list[list[dict[str, Any]]] = []
    params: dict[str, Any] = {"page_size": page_size}
    while True:
        page = _page(stack, index, who, **params)
        pages.append(page["documents"])
        if page["next_page_token"] is None:
            return pages
        params["page_token"] = page["next_page_token"]


def _count(stack: Stack, index: str, who: dict[str, str] = ACME) -> int:
    return int(stack.live.get(f"/v1/indexes/{index}", headers=who).json()["documents"])


def test_pages_by_id_with_no_repeat_and_no_gap_and_a_write_between_pages(stack: Stack) -> None:
    ingest(stack, "dl-pages", _docs(IDS, "alpha"), ACME)
    pages = _all_pages(stack, "dl-pages", 3)
    assert [len(p) for p in pages] == [3, 3, 2]  # the last page says so: no empty page after
    listed = [d["id"] for p in pages for d in p]
    assert listed == sorted(IDS) and len(listed) == _count(stack, "dl-pages")
    first = pages[0][0]
    stored = stack.live.get("/v1/indexes/dl-pages/documents/B2", headers=ACME).json()
    assert first["id"] == "B2"
    assert {k: first[k] for k in ("title", "revision", "metadata", "version")} == {
        k: stored[k] for k in ("title", "revision", "metadata", "version")
    }
    assert first["text_preview"] == stored["text"][:200] and first["text_length"] == len(
        stored["text"]
    )
    assert "text" not in first and "vector" not in first
    # writes between pages: an id before the cursor is not shown, one after is; none twice
    one = _page(stack, "dl-pages", page_size=3)
    ingest(stack, "dl-pages", _docs(["a0", "zz"], "beta"), ACME)
    rest = _page(stack, "dl-pages", page_size=100, page_token=one["next_page_token"])
    assert [d["id"] for d in one["documents"] + rest["documents"]] == sorted([*IDS, "zz"])
    assert rest["next_page_token"] is None


def test_a_finished_delete_job_leaves_the_listing_and_the_count_agrees(stack: Stack) -> None:
    ingest(stack, "dl-deletes", _docs(IDS, "gamma"), ACME)
    job = stack.live.post(
        "/v1/indexes/dl-deletes/documents/delete",
        params={"wait": 20},
        json={"ids": ["a2", "c/2", "é1", "nope"]},
        headers=ACME,
    ).json()
    assert job["status"] == "succeeded" and job["deleted"] == 3, job
    listed = [d["id"] for p in _all_pages(stack, "dl-deletes", 2) for d in p]
    assert listed == sorted(set(IDS) - {"a2", "c/2", "é1"})
    assert len(listed) == _count(stack, "dl-deletes") == 5
    dropped = stack.live.delete("/v1/indexes/dl-deletes", params={"wait": 20}, headers=ACME)
    assert dropped.json()["status"] == "succeeded", dropped.text
    gone = stack.live.get("/v1/indexes/dl-deletes/documents", headers=ACME)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "index_not_found"


def test_two_tenants_of_the_same_names_and_ids_each_list_their_own(stack: Stack) -> None:
    ingest(stack, "dl-shared", _docs(IDS[:4], "acme"), ACME)
    ingest(stack, "dl-shared", _docs(IDS[2:], "globex"), GLOBEX)
    ingest(stack, "dl-acme-only", _docs(IDS[:1], "acme"), ACME)
    acme = _page(stack, "dl-shared", ACME)["documents"]
    globex = _page(stack, "dl-shared", GLOBEX)["documents"]
    assert [d["id"] for d in acme] == sorted(IDS[:4])
    assert [d["id"] for d in globex] == sorted(IDS[2:])
    assert all(d["title"].startswith("acme") for d in acme)
    assert all(d["title"].startswith("globex") for d in globex)
    # globex asking for acme's index answers exactly what it answers for a name nobody has,
    # and what GET /v1/indexes/{index} answers
    answers = []
    for name in ("dl-acme-only", "dl-nobody"):
        for path in (f"/v1/indexes/{name}/documents", f"/v1/indexes/{name}"):
            response = stack.live.get(path, headers=GLOBEX)
            answers.append((response.status_code, same_shape(response.json(), name)))
    assert answers[0][0] == 404 and len(set(map(str, answers))) == 1, answers
    # a token is the listing's own: acme's token, given by globex, is refused
    token = _page(stack, "dl-shared", ACME, page_size=1)["next_page_token"]
    stolen = stack.live.get(
        "/v1/indexes/dl-shared/documents", params={"page_token": token}, headers=GLOBEX
    )
    assert stolen.status_code == 422 and stolen.json()["error"]["field"] == "page_token"


def test_a_bad_page_size_or_token_is_a_422_naming_it(stack: Stack) -> None:
    ingest(stack, "dl-bad", _docs(IDS[:3], "delta"), ACME)
    token = _page(stack, "dl-bad", page_size=1)["next_page_token"]
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    kind, digest, last = raw.split(":", 2)
    edited = base64.urlsafe_b64encode(f"{kind}:{digest}:a2".encode()).decode().rstrip("=")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"page_size": 0}, "page_size"),
        ({"page_size": 1001}, "page_size"),
        ({"page_size": "ten"}, "page_size"),
        ({"page_token": ""}, "page_token"),
        ({"page_token": "not-a-token"}, "page_token"),
        ({"page_token": token[:-2]}, "page_token"),
        ({"page_token": edited}, "page_token"),  # another id under the same digest
        ({"page_token": "x" * 3000}, "page_token"),
        ({"limit": 5}, "limit"),  # not a parameter of this route: named, not ignored
    ]
    for params, field in cases:
        response = stack.live.get("/v1/indexes/dl-bad/documents", params=params, headers=ACME)
        assert response.status_code == 422, (params, response.text)
        assert response.json()["error"]["field"] == field, (params, response.text)
    # the same token on another of acme's indexes is refused too (it names dl-bad's id)
    ingest(stack, "dl-bad-2", _docs(IDS[:3], "delta"), ACME)
    other = stack.live.get(
        "/v1/indexes/dl-bad-2/documents", params={"page_token": token}, headers=ACME
    )
    assert other.status_code == 422 and other.json()["error"]["field"] == "page_token"
    assert last == IDS[0]


def test_a_page_ends_at_the_byte_budget_and_goes_on_from_there(stack: Stack) -> None:
    """A listed document shows its metadata whole: up to 100 values of 8 kB (~830 kB), so a
    page of 1,000 of them was 830 MB, read, passed through Redis and parsed at once."""
    metadata = {f"k{j:03d}": f"{j}".ljust(MAX_METADATA_VALUE_BYTES, "v") for j in range(100)}
    size = len(json.dumps(metadata, separators=(",", ":")))
    ids = [f"m{i:02d}" for i in range(MAX_LIST_READ_BYTES // size + 3)]  # past one page
    ingest(stack, "dl-bytes", [{"id": i, "text": f"note {i}", "metadata": metadata} for i in ids])
    pages = _all_pages(stack, "dl-bytes", DEFAULT_PAGE_SIZE)
    assert [d["id"] for p in pages for d in p] == ids  # by id, none twice, none skipped
    assert all(d["metadata"] == metadata for p in pages for d in p)
    # each page ended at the budget: more than one such document, never all of them
    assert all(1 <= len(p) <= MAX_LIST_READ_BYTES // size for p in pages), [len(p) for p in pages]
    assert len(pages[0]) > 1, [len(p) for p in pages]
