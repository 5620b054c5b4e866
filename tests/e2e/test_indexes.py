"""The index lifecycle over the real stack: list, show, read a document, delete documents
and an index (jobs polled at /v1/ingestions/{id}), on the embedded backend."""

from __future__ import annotations

import base64
import json
import time
from typing import Any
from urllib.parse import quote

import httpx

from api_gateway.queue import OutboxSender
from tests.e2e.conftest import ACME, GLOBEX, Stack, ingest
from worker.constants import INGEST_QUEUE, INGEST_TASK
from worker.contract import DocumentIn
from worker.queue.jobstore import JobStore

# words no other test's corpus holds, so a search for them finds only these documents
DOCS = [
    {
        "id": "z1",
        "title": "Zanzibar cloves",
        "text": "zanzibar clove harvest season",
        "metadata": {"k": "a"},
    },
    {
        "id": "z2",
        "title": "Quokka",
        "text": "quokka smiles on rottnest island",
        "metadata": {"k": "b"},
    },
    {
        "id": "z3",
        "title": "Xylophone",
        "text": "xylophone mallets of rosewood",
        "metadata": {"k": "c"},
    },
]


def _poll_job(client: httpx.Client, path: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        body = dict(client.get(path, headers=ACME).json())
        if body["status"] in ("succeeded", "failed") or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def _search(stack: Stack, index: str, query: str, mode: str = "hybrid") -> dict[str, Any]:
    response = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": index, "query": query, "mode": mode, "include_trace": True, "limit": 50},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _hit_ids(job: dict[str, Any]) -> set[str]:
    return {h["id"] for h in job["result"]["hits"]} if job.get("result") else set()


def test_list_and_show_an_index(stack: Stack) -> None:
    ingest(stack, "life-list", DOCS)
    listed = stack.live.get("/v1/indexes", headers=ACME)
    assert listed.status_code == 200, listed.text
    mine = {i["name"]: i for i in listed.json()["indexes"]}
    info = mine["life-list"]
    assert info["documents"] == 3 and info["backend"] == "embedded"
    assert info["embedding_model"] and info["dimensions"] == 384
    assert info["last_write_at"]
    shown = stack.live.get("/v1/indexes/life-list", headers=ACME)
    assert shown.status_code == 200 and shown.json() == info
    missing = stack.live.get("/v1/indexes/life-nobody", headers=ACME)
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "index_not_found"
    assert missing.json()["error"]["field"] == "index"


def test_list_pages_with_strict_tokens(stack: Stack) -> None:
    for n in range(3):
        ingest(stack, f"life-page-{n}", DOCS[:1])
    everything = [i["name"] for i in stack.live.get("/v1/indexes", headers=ACME).json()["indexes"]]
    seen: list[str] = []
    token: str | None = None
    while True:
        params: dict[str, Any] = {"page_size": 1, **({"page_token": token} if token else {})}
        page = stack.live.get("/v1/indexes", params=params, headers=ACME).json()
        seen += [i["name"] for i in page["indexes"]]
        token = page["next_page_token"]
        if token is None:
            break
    assert seen == everything and {"life-page-0", "life-page-1", "life-page-2"} <= set(seen)
    for bad in ("", "bm90LWEtdG9rZW4", "o:1", "b06x"):
        response = stack.live.get("/v1/indexes", params={"page_token": bad}, headers=ACME)
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"]["field"] == "page_token"
    response = stack.live.get("/v1/indexes", params={"page_size": 0}, headers=ACME)
    assert response.status_code == 422 and "page_size" in response.text


def _index_pages(stack: Stack, page_size: int, after_each: Any = None) -> list[list[str]]:
    """Every page of acme's indexes, by name; ``after_each(names)`` runs after each page."""
    pages: list[list[str]] = []
    params: dict[str, Any] = {"page_size": page_size}
    while True:
        response = stack.live.get("/v1/indexes", params=params, headers=ACME)
        assert response.status_code == 200, response.text
        page = response.json()
        pages.append([i["name"] for i in page["indexes"]])
        if after_each is not None:
            after_each(pages[-1])
        if page["next_page_token"] is None:
            return pages
        params["page_token"] = page["next_page_token"]


def test_dropping_the_indexes_of_each_page_skips_none_after_it(stack: Stack) -> None:
    """The audit's case: indexes p0..p7 paged 2 at a time, each page's dropped once read.
    A token that was an offset skipped p2, p3, p6 and p7 (the drops moved them back across
    the page's edge); a page now starts after the last name listed, so each is seen once.
    Indexes written between pages: one after the cursor is listed, one before it is not."""
    ours = [f"cursor-p{n}" for n in range(8)]
    for name in ours:
        ingest(stack, name, DOCS[:1])

    def drop_ours(names: list[str]) -> None:
        for name in names:
            if name in ours:
                dropped = stack.live.delete(
                    f"/v1/indexes/{name}", params={"wait": 20}, headers=ACME
                )
                assert dropped.json()["status"] == "succeeded", dropped.text

    listed = [n for page in _index_pages(stack, 2, drop_ours) for n in page]
    assert [n for n in listed if n in ours] == ours
    assert len(listed) == len(set(listed))

    # written between pages: a name behind the cursor is not shown, one after it is;
    # dropped: not shown; none twice, and one there throughout never missed
    for name in ("cursor-q1", "cursor-q3", "cursor-q4"):
        ingest(stack, name, DOCS[:1])
    seen, token = _pages_through(stack, "cursor-q1")
    for name in ("cursor-q0", "cursor-q2"):
        ingest(stack, name, DOCS[:1])
    stack.live.delete("/v1/indexes/cursor-q4", params={"wait": 20}, headers=ACME)
    rest = stack.live.get(
        "/v1/indexes", params={"page_size": 1000, "page_token": token}, headers=ACME
    ).json()
    seen += [i["name"] for i in rest["indexes"]]
    assert len(seen) == len(set(seen)) and rest["next_page_token"] is None
    assert [n for n in seen if n.startswith("cursor-q")] == ["cursor-q1", "cursor-q2", "cursor-q3"]
    for name in ("cursor-q0", "cursor-q1", "cursor-q2", "cursor-q3"):
        stack.live.delete(f"/v1/indexes/{name}", params={"wait": 20}, headers=ACME)


def _pages_through(stack: Stack, name: str) -> tuple[list[str], str]:
    """Acme's indexes a page of one at a time up to ``name``'s page, and that page's token."""
    seen: list[str] = []
    params: dict[str, Any] = {"page_size": 1}
    while True:
        page = stack.live.get("/v1/indexes", params=params, headers=ACME).json()
        seen += [i["name"] for i in page["indexes"]]
        params["page_token"] = page["next_page_token"]
        if seen[-1] == name:
            return seen, str(params["page_token"])
        assert params["page_token"] is not None, (name, seen)


def test_an_index_list_token_is_its_tenants_and_its_lists_own(stack: Stack) -> None:
    """Acme's token given by globex is a 422 naming ``page_token`` that tells globex nothing
    (not the name the token starts after, nor the token); so is a document listing's
    token, and the offset tokens this list gave before (``o:<offset>``)."""
    for name in ("tok-secret-a", "tok-secret-b"):
        ingest(stack, name, DOCS[:1])
    _, token = _pages_through(stack, "tok-secret-a")  # acme's own tokens serve acme
    stolen = stack.live.get("/v1/indexes", params={"page_token": token}, headers=GLOBEX)
    assert stolen.status_code == 422, stolen.text
    assert stolen.json()["error"]["field"] == "page_token"
    assert (
        "tok-secret" not in stolen.text and token not in stolen.text and "acme" not in stolen.text
    )
    mine = stack.live.get("/v1/indexes", params={"page_token": token}, headers=ACME)
    assert mine.status_code == 200 and mine.json()["indexes"][0]["name"] > "tok-secret-a"
    ingest(stack, "tok-secret-a", DOCS)  # three documents: the listing has a next page
    docs_token = stack.live.get(
        "/v1/indexes/tok-secret-a/documents", params={"page_size": 1}, headers=ACME
    ).json()["next_page_token"]
    offset = base64.urlsafe_b64encode(b"o:1").decode().rstrip("=")
    for bad in (docs_token, offset, token[:-2]):
        response = stack.live.get("/v1/indexes", params={"page_token": bad}, headers=ACME)
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"]["field"] == "page_token"


def test_get_a_document_as_stored(stack: Stack) -> None:
    ingest(stack, "life-get", DOCS)
    response = stack.live.get("/v1/indexes/life-get/documents/z2", headers=ACME)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["id"] == "z2" and doc["text"] == DOCS[1]["text"] and doc["title"] == "Quokka"
    assert doc["metadata"] == {"k": "b"} and doc["revision"]
    assert isinstance(doc["version"], int) and "vector" not in doc
    for path in ("/v1/indexes/life-get/documents/nope", "/v1/indexes/life-nobody/documents/z2"):
        assert stack.live.get(path, headers=ACME).status_code == 404


def test_delete_a_document_leaves_no_channel_and_reingest_works(stack: Stack) -> None:
    ingest(stack, "life-del", DOCS)
    before = _search(stack, "life-del", "quokka rottnest island")
    assert "z2" in _hit_ids(before)
    response = stack.live.delete("/v1/indexes/life-del/documents/z2", headers=ACME)
    assert response.status_code == 202, response.text
    assert response.headers["Location"] == f"/v1/ingestions/{response.json()['id']}"
    job = _poll_job(stack.live, response.headers["Location"])
    assert job["status"] == "succeeded" and job["operation"] == "delete"
    assert job["deleted"] == 1 and job["documents"] == 1
    for mode in ("fts", "vector", "hybrid"):  # each channel alone, and fused with the trace
        after = _search(stack, "life-del", "quokka rottnest island", mode)
        assert "z2" not in _hit_ids(after), mode
        assert '"z2"' not in json.dumps(after["result"]), mode
    batch = stack.live.post(
        "/v1/batches",
        json={"index": "life-del", "queries": [{"id": "q", "query": "quokka island"}]},
        headers=ACME,
    ).json()
    deadline = time.monotonic() + 30
    while stack.live.get(f"/v1/batches/{batch['id']}", headers=ACME).json()["status"] not in (
        "succeeded",
        "failed",
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    results = stack.live.get(f"/v1/batches/{batch['id']}/results", headers=ACME).json()
    assert '"z2"' not in json.dumps(results)
    assert stack.live.get("/v1/indexes/life-del/documents/z2", headers=ACME).status_code == 404
    assert stack.live.get("/v1/indexes/life-del", headers=ACME).json()["documents"] == 2
    # a result stored before the delete is a snapshot, kept for the retention with the text
    # (docs/indexes.md, "Deletes are jobs": the docs said no search returned it any more)
    stored = stack.live.get(f"/v1/searches/{before['id']}", headers=ACME).json()
    assert "z2" in _hit_ids(stored) and "rottnest" in json.dumps(stored["result"])
    ingest(stack, "life-del", [DOCS[1]])  # the same id again
    assert "z2" in _hit_ids(_search(stack, "life-del", "quokka rottnest island", "fts"))
    assert "z2" in _hit_ids(_search(stack, "life-del", "quokka rottnest island", "vector"))


def test_bulk_delete_with_wait(stack: Stack) -> None:
    ingest(stack, "life-bulk", DOCS)
    response = stack.live.post(
        "/v1/indexes/life-bulk/documents/delete",
        params={"wait": 20},
        json={"ids": ["z1", "z3", "z1", "never-was"]},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "succeeded" and job["deleted"] == 2 and job["documents"] == 3
    assert stack.live.get(f"/v1/ingestions/{job['id']}", headers=ACME).json() == job
    assert _hit_ids(_search(stack, "life-bulk", "zanzibar xylophone quokka", "fts")) == {"z2"}
    for body, field in (
        ({"ids": []}, "ids"),
        ({"ids": [""]}, "ids[0]"),
        ({"ids": ["x"] * 1001}, "ids"),
        ({"ids": ["x"], "extra": 1}, "extra"),
    ):
        bad = stack.live.post("/v1/indexes/life-bulk/documents/delete", json=body, headers=ACME)
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["field"] == field, bad.text


def test_delete_an_index(stack: Stack) -> None:
    ingest(stack, "life-drop", DOCS)
    response = stack.live.delete("/v1/indexes/life-drop", params={"wait": 20}, headers=ACME)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["operation"] == "drop" and job["deleted"] == 3
    assert stack.live.get("/v1/indexes/life-drop", headers=ACME).status_code == 404
    names = {i["name"] for i in stack.live.get("/v1/indexes", headers=ACME).json()["indexes"]}
    assert "life-drop" not in names
    search = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": "life-drop", "query": "quokka"},
        headers=ACME,
    ).json()
    assert search["status"] == "failed" and search["error"]["type"] == "index_not_found"
    ingest(stack, "life-drop", DOCS[:1])  # the name is usable again
    assert stack.live.get("/v1/indexes/life-drop", headers=ACME).json()["documents"] == 1
    bad = stack.live.delete("/v1/indexes/Not_Valid", headers=ACME)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "index"


def test_a_bulk_delete_and_an_index_drop_answered_202_say_where_their_job_is(
    stack: Stack,
) -> None:
    """Every ``202`` carries ``Location`` (issue 13), these two as the single delete does."""
    ingest(stack, "life-where", DOCS)
    bulk = stack.live.post(
        "/v1/indexes/life-where/documents/delete", json={"ids": ["z1"]}, headers=ACME
    )
    drop = stack.live.delete("/v1/indexes/life-where", headers=ACME)
    for response in (bulk, drop):
        assert response.status_code == 202, response.text
        assert response.headers["Location"] == f"/v1/ingestions/{response.json()['id']}"
    assert _poll_job(stack.live, bulk.headers["Location"])["status"] == "succeeded"
    assert _poll_job(stack.live, drop.headers["Location"])["operation"] == "drop"


def test_deleting_every_document_by_id_leaves_no_index(stack: Stack) -> None:
    """An index exists while it holds a document, however the last one went (unlike an
    Elasticsearch index, which stays when emptied): unlisted, 404, searches fail as for a
    name nobody has, and the name works again."""
    ingest(stack, "life-empty", DOCS)
    response = stack.live.post(
        "/v1/indexes/life-empty/documents/delete",
        params={"wait": 20},
        json={"ids": [d["id"] for d in DOCS]},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded" and response.json()["deleted"] == 3
    shown = stack.live.get("/v1/indexes/life-empty", headers=ACME)
    nobody = stack.live.get("/v1/indexes/life-nobody-at-all", headers=ACME)
    assert shown.status_code == nobody.status_code == 404
    assert shown.json()["error"]["type"] == "index_not_found"
    names = {i["name"] for i in stack.live.get("/v1/indexes", headers=ACME).json()["indexes"]}
    assert "life-empty" not in names
    for mode in ("fts", "vector", "hybrid"):
        search = stack.live.post(
            "/v1/searches",
            params={"wait": 20},
            json={"index": "life-empty", "query": "quokka", "mode": mode},
            headers=ACME,
        ).json()
        assert search["status"] == "failed", mode
        assert search["error"]["type"] == "index_not_found", mode
    ingest(stack, "life-empty", DOCS[1:2])  # the name is usable again
    assert stack.live.get("/v1/indexes/life-empty", headers=ACME).json()["documents"] == 1
    assert _hit_ids(_search(stack, "life-empty", "quokka rottnest island", "hybrid")) == {"z2"}
    dropped = stack.live.delete("/v1/indexes/life-empty", params={"wait": 20}, headers=ACME)
    assert dropped.status_code == 200 and dropped.json()["deleted"] == 1


def test_a_read_no_worker_answers_is_503_not_a_hang(stack: Stack) -> None:
    """The idle gateway's database has no worker: the read waits its 10 s, then says so."""
    response = stack.idle.get("/v1/indexes/life-list", headers=ACME)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "backend_unavailable" and "no worker answered" in error["message"]


def test_ids_with_slashes_and_spaces_are_addressable(stack: Stack) -> None:
    odd = {"id": "dir/sub file.txt", "text": "tamarind chutney recipe"}
    ingest(stack, "life-odd", [odd])
    path = "/v1/indexes/life-odd/documents/dir%2Fsub%20file.txt"
    got = stack.live.get(path, headers=ACME)
    assert got.status_code == 200 and got.json()["id"] == odd["id"], got.text
    assert (
        stack.live.get("/v1/indexes/life-odd/documents/dir/sub file.txt", headers=ACME).json()[
            "text"
        ]
        == odd["text"]
    )
    gone = stack.live.delete(path, params={"wait": 20}, headers=ACME).json()
    assert gone["deleted"] == 1
    assert stack.live.get(path, headers=ACME).status_code == 404


def test_an_encoded_slash_never_makes_a_path_parameter_reach_another_route(
    stack: Stack,
) -> None:
    """The server decodes ``%2F`` before routing, so a slash inside a parameter was a segment
    boundary: ``DELETE /v1/indexes/demo%2Fdocuments%2Fd1`` (the drop of an index named
    ``demo/documents/d1``) deleted document ``d1`` of ``demo``, and ``GET
    /v1/indexes/demo%2Fdocuments`` listed its documents. An index name holds no slash: such a
    path is ``422`` naming ``index``; a document id may hold one, and ``%2F`` in it reaches
    that very document."""
    docs = [
        {"id": "chess-3", "text": "a rook endgame on the seventh rank"},
        {"id": "chess/3", "text": "a bishop pair in the middlegame"},
    ]
    ingest(stack, "life-slash", docs)
    for method, path in [
        ("DELETE", "/v1/indexes/life-slash%2Fdocuments%2Fchess-3"),
        ("DELETE", "/v1/indexes/life-slash%2fdocuments%2fchess-3"),
        ("GET", "/v1/indexes/life-slash%2Fdocuments%2Fchess-3"),
        ("GET", "/v1/indexes/life-slash%2Fdocuments"),
        ("PATCH", "/v1/indexes/life-slash%2Fdocuments"),
    ]:
        body = {"candidate_limit": 10} if method == "PATCH" else None
        params = {"wait": 5} if method == "DELETE" else None
        got = stack.live.request(method, path, params=params, json=body, headers=ACME)
        assert got.status_code == 422, (method, path, got.text)
        assert got.json()["error"]["field"] == "index", got.text
    # a literal segment with an encoded slash is no route's (it bulk-deleted by id)
    bulk = stack.live.post(
        "/v1/indexes/life-slash/documents%2Fdelete",
        params={"wait": 5},
        json={"ids": ["chess-3"]},
        headers=ACME,
    )
    assert bulk.status_code == 404 and bulk.json()["error"]["field"] == "path", bulk.text
    listed = stack.live.get("/v1/indexes/life-slash/documents", headers=ACME).json()
    assert sorted(d["id"] for d in listed["documents"]) == ["chess-3", "chess/3"], listed
    # an id with a slash, sent encoded, is that document: read, then deleted alone
    base = "/v1/indexes/life-slash/documents/"
    got = stack.live.get(base + "chess%2F3", headers=ACME)
    assert got.status_code == 200 and got.json()["text"] == docs[1]["text"], got.text
    gone = stack.live.delete(base + "chess%2f3", params={"wait": 20}, headers=ACME)
    assert gone.status_code == 200 and gone.json()["deleted"] == 1, gone.text
    kept = stack.live.get(base + "chess-3", headers=ACME)
    assert kept.status_code == 200 and kept.json()["text"] == docs[0]["text"], kept.text


def test_an_id_with_a_line_break_is_that_document_not_another(stack: Stack) -> None:
    """The id's route matched ``.*``, which stops at a line break, then ``$``, which matches
    before a last one: ``GET .../documents/d1%0A`` read document ``d1``, and its ``DELETE``
    deleted ``d1`` (``deleted: 1``) and left ``d1\n``; an id with a line break inside was
    ``404`` "no route". Such ids are taken, listed and deleted in bulk, so each must be
    addressable alone."""
    docs = [
        {"id": "d1", "text": "marmalade without a line break"},
        {"id": "d1\n", "text": "marmalade after a line break"},
        {"id": "line\nbreak", "text": "marmalade split by a line break"},
    ]
    ingest(stack, "life-breaks", docs)
    base = "/v1/indexes/life-breaks/documents/"
    for doc in docs[1:]:
        got = stack.live.get(base + quote(doc["id"], safe=""), headers=ACME)
        assert got.status_code == 200 and got.json()["text"] == doc["text"], got.text
    gone = stack.live.delete(base + "d1%0A", params={"wait": 20}, headers=ACME)
    assert gone.status_code == 200 and gone.json()["deleted"] == 1, gone.text
    listed = stack.live.get(base.rstrip("/"), headers=ACME).json()["documents"]
    assert sorted(d["id"] for d in listed) == ["d1", "line\nbreak"]
    gone = stack.live.delete(base + "line%0Abreak", params={"wait": 20}, headers=ACME)
    assert gone.status_code == 200 and gone.json()["deleted"] == 1, gone.text
    assert stack.live.get(base + "d1", headers=ACME).json()["text"] == docs[0]["text"]


def test_an_upsert_accepted_before_the_last_documents_delete_keeps_the_settings(
    stack: Stack,
) -> None:
    """New documents sent, then the old deleted, the delete's task run first (the upsert's
    still embedding): the index is empty for that moment, but never in the order the writes
    were accepted. The worker's delete kept the index's settings for the upsert to land
    into; it used to clear them, and the index went on at the defaults."""
    ingest(stack, "life-replace", DOCS[:1])
    patched = stack.live.patch(
        "/v1/indexes/life-replace", json={"candidate_limit": 33}, headers=ACME
    )
    assert patched.status_code == 200, patched.text
    store = JobStore.from_url(stack.redis_url + "/0")
    try:
        # accepted as the gateway accepts it, its task message held back (still embedding)
        upsert = store.create_ingest("acme", "life-replace", [DocumentIn(**DOCS[1])])
        deleted = stack.live.post(
            "/v1/indexes/life-replace/documents/delete",
            params={"wait": 20},
            json={"ids": ["z1"]},
            headers=ACME,
        )
        assert deleted.status_code == 200 and deleted.json()["deleted"] == 1, deleted.text
        OutboxSender(store).send(INGEST_TASK, [upsert.id], INGEST_QUEUE)
    finally:
        store.close()
    assert _poll_job(stack.live, f"/v1/ingestions/{upsert.id}")["status"] == "succeeded"
    shown = stack.live.get("/v1/indexes/life-replace", headers=ACME).json()
    assert shown["documents"] == 1 and shown["settings"]["candidate_limit"] == 33, shown


def test_a_path_whose_percent_escapes_are_not_utf8_is_422_naming_it(stack: Stack) -> None:
    """The server decoded ``%C0`` (no UTF-8) with a replacement character, so
    ``DELETE .../documents/%C0`` deleted the document whose id is ``"\\ufffd"``: a malformed
    path reached another document. Such a path is now ``422`` naming the parameter, and the
    document with that id (sent as its UTF-8, ``%EF%BF%BD``) is still there and addressable."""
    docs = [{"id": "\ufffd", "text": "replacement character marmalade"}]
    ingest(stack, "life-escapes", docs)
    base = "/v1/indexes/life-escapes/documents/"
    for method in ("GET", "DELETE"):
        for bad in ("%C0", "%FF", "%FE", "ok%C0ok", "a/%FF", "a%2F%FF"):
            got = stack.live.request(method, base + bad, headers=ACME)
            assert got.status_code == 422, (method, bad, got.text)
            assert got.json()["error"]["field"] == "id", got.text
        got = stack.live.request(method, "/v1/indexes/%C0/documents/x", headers=ACME)
        assert got.status_code == 422 and got.json()["error"]["field"] == "index", got.text
    for path in ("/v1/indexes/%FF", "/v1/indexes/%FF%2Fdocuments"):  # the latter, one segment
        got = stack.live.get(path, headers=ACME)
        assert got.status_code == 422 and got.json()["error"]["field"] == "index", got.text
    kept = stack.live.get(base + "%EF%BF%BD", headers=ACME)
    assert kept.status_code == 200 and kept.json()["text"] == docs[0]["text"], kept.text


def test_the_document_id_parameter_is_named_id(stack: Stack) -> None:
    """DESIGN.md §9 names it ``id`` (``/documents/{id}``), as the 404 does; the OpenAPI
    document and a 422 named it ``doc_id``."""
    paths = stack.live.get("/openapi.json").json()["paths"]
    template = "/v1/indexes/{index}/documents/{id}"
    assert template in paths, sorted(paths)
    for operation in paths[template].values():
        names = [p["name"] for p in operation["parameters"] if p["in"] == "path"]
        assert names == ["index", "id"]
    too_long = stack.live.get("/v1/indexes/docs/documents/" + "x" * 600, headers=ACME)
    assert too_long.status_code == 422 and too_long.json()["error"]["field"] == "id"
    # a document the caller's index lacks (an index it lacks is the 404 naming ``index``)
    body = {"documents": [{"id": "here", "text": "green tea"}]}
    path = "/v1/indexes/id-named/documents"
    ingested = stack.live.post(path, params={"wait": 20}, json=body, headers=ACME)
    assert ingested.status_code == 200, ingested.text
    missing = stack.live.get(f"{path}/nobody-here", headers=ACME)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "id"


def test_the_gateways_ingest_and_delete_log_lines_carry_their_job_id(stack: Stack) -> None:
    """Every log record carries the job id in its ``[...]`` slot (STYLE.md 11); the gateway's
    own lines for an ingest and a delete had ``[-]`` there, the id in the message alone."""
    ingested = ingest(stack, "life-logs", [{"id": "l1", "text": "log line marmalade"}])
    gone = stack.live.delete(
        "/v1/indexes/life-logs/documents/l1", params={"wait": 20}, headers=ACME
    ).json()
    log = stack.logs[1].read_text(errors="replace")  # the live gateway's
    for job in (ingested["id"], gone["id"]):
        lines = [line for line in log.splitlines() if f"ingest {job}:" in line]
        assert lines and all(f"[{job}]" in line for line in lines), (job, lines)


def _names(stack: Stack, headers: dict[str, str]) -> list[str]:
    names: list[str] = []
    params: dict[str, Any] = {"page_size": 1000}
    while True:
        page = stack.live.get("/v1/indexes", params=params, headers=headers).json()
        names += [i["name"] for i in page["indexes"]]
        if page["next_page_token"] is None:
            return names
        params["page_token"] = page["next_page_token"]


def test_a_tenant_holds_at_most_100_indexes_at_the_defaults(stack: Stack) -> None:
    """SIFT_MAX_INDEXES_PER_TENANT at its default: the ingest that would make a tenant's
    101st index fails ``index_limit_reached``, not retried, writing nothing; the other
    tenant is not held by it, and a drop frees a place."""
    held = len(_names(stack, GLOBEX))
    mine = [f"cap-{i:03d}" for i in range(100 - held)]
    try:
        for name in mine:
            response = stack.live.post(
                f"/v1/indexes/{name}/documents",
                params={"wait": 20},
                json={"documents": DOCS[:1]},
                headers=GLOBEX,
            )
            assert response.status_code == 200 and response.json()["upserted"] == 1, response.text
        refused = stack.live.post(
            "/v1/indexes/cap-over/documents",
            params={"wait": 20},
            json={"documents": DOCS[:1]},
            headers=GLOBEX,
        )
        assert refused.status_code == 200, refused.text
        job = refused.json()
        assert job["status"] == "failed" and not job["upserted"], job
        assert job["error"]["type"] == "index_limit_reached" and not job["error"]["retryable"]
        assert "holds 100 indexes" in job["error"]["message"]
        assert "cap-over" not in _names(stack, GLOBEX)
        assert stack.live.get("/v1/indexes/cap-over", headers=GLOBEX).status_code == 404
        ingest(stack, "cap-over", DOCS[:1])  # acme's count is its own
        dropped = stack.live.delete(f"/v1/indexes/{mine[0]}", params={"wait": 20}, headers=GLOBEX)
        assert dropped.status_code == 200, dropped.text
        again = stack.live.post(
            "/v1/indexes/cap-over/documents",
            params={"wait": 20},
            json={"documents": DOCS[:1]},
            headers=GLOBEX,
        )
        assert again.json()["status"] == "succeeded", again.text
    finally:
        for name in [*mine, "cap-over"]:
            stack.live.delete(f"/v1/indexes/{name}", params={"wait": 20}, headers=GLOBEX)
        stack.live.delete("/v1/indexes/cap-over", params={"wait": 20}, headers=ACME)
