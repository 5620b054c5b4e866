"""Another tenant's job reads, byte for byte, like one that never existed.

Over the real stack: globex holds a search, a batch and an ingest job; acme asks for each by
id on every route that takes one (``GET`` the job, a batch's result pages with and without
a page token, ``DELETE`` a batch). Each answer is compared with the answer to a made-up id
of the same shape: the same status, the same headers (the date aside), and the same body
once the id it echoes is swapped. Nothing in any of them tells that the id exists. Nor does
an id itself say who made it, or how many jobs others made before it: ids are random.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from api_gateway.tokens import encode_results_token
from tests.e2e.conftest import ACME, GLOBEX, Stack

INDEX = "foreign-ids"


@pytest.fixture(scope="module")
def globex_jobs(stack: Stack) -> dict[str, str]:
    """globex's search (finished), batch and ingest job, by kind."""
    ingest = stack.live.post(
        f"/v1/indexes/{INDEX}/documents",
        params={"wait": 20},
        json={"documents": [{"id": "g", "text": "globex hello"}]},
        headers=GLOBEX,
    )
    assert ingest.status_code == 200, ingest.text
    search = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": INDEX, "query": "hello"},
        headers=GLOBEX,
    )
    assert search.status_code == 200, search.text
    batch = stack.live.post(
        "/v1/batches",
        json={"index": INDEX, "queries": [{"id": "q", "query": "hello"}]},
        headers=GLOBEX,
    )
    assert batch.status_code == 202, batch.text
    jobs = {"search": search, "batch": batch, "ingest": ingest}
    return {kind: str(response.json()["id"]) for kind, response in jobs.items()}


def seen(response: httpx.Response, job_id: str) -> tuple[int, dict[str, str], str]:
    headers = {k: v for k, v in response.headers.items() if k != "date"}
    return response.status_code, headers, response.text.replace(job_id, "<id>")


ROUTES = [
    ("GET", "/v1/searches/{}", "search"),
    ("GET", "/v1/ingestions/{}", "ingest"),
    ("GET", "/v1/batches/{}", "batch"),
    ("GET", "/v1/batches/{}/results", "batch"),
    # with a page token the API issues for that id ({1}): bound to its batch, not an owner
    ("GET", "/v1/batches/{0}/results?page_size=1&page_token={1}", "batch"),
    ("DELETE", "/v1/batches/{}", "batch"),
    # the erases: another tenant's job is not erased, and answers as none
    ("DELETE", "/v1/searches/{}", "search"),
    ("DELETE", "/v1/batches/{}/results", "batch"),
]


def _at(path: str, job_id: str) -> str:
    """``path`` for ``job_id``, with the page token the API issues for its results' page 2."""
    return path.format(job_id, encode_results_token(job_id, 1))


@pytest.mark.parametrize(("method", "path", "kind"), ROUTES)
def test_another_tenants_job_answers_exactly_as_a_made_up_id(
    stack: Stack, globex_jobs: dict[str, str], method: str, path: str, kind: str
) -> None:
    theirs = globex_jobs[kind]
    made_up = theirs.split("_")[0] + "_" + uuid.uuid4().hex
    foreign = stack.live.request(method, _at(path, theirs), headers=ACME)
    nobodys = stack.live.request(method, _at(path, made_up), headers=ACME)
    assert foreign.status_code == 404, foreign.text
    assert seen(foreign, theirs) == seen(nobodys, made_up)
    # and the owner still reads it (the DELETE above changed nothing of globex's)
    owner = stack.live.get(_at(path, theirs).split("?")[0].removesuffix("/results"),
                           headers=GLOBEX)  # fmt: skip
    assert owner.status_code == 200, owner.text
    assert owner.json().get("canceled_at") is None


def test_another_tenants_erased_job_answers_exactly_as_a_made_up_id(stack: Stack) -> None:
    """An erased job's mark answers its own tenant ``410 erased``, and every other tenant as
    if the id had never been made (``404``, byte for byte)."""
    search = stack.live.post(
        "/v1/searches", params={"wait": 20}, json={"index": INDEX, "query": "hi"}, headers=GLOBEX
    )
    assert search.status_code == 200, search.text
    theirs = str(search.json()["id"])
    assert stack.live.delete(f"/v1/searches/{theirs}", headers=GLOBEX).status_code == 200
    assert stack.live.get(f"/v1/searches/{theirs}", headers=GLOBEX).status_code == 410
    made_up = "srch_" + uuid.uuid4().hex
    for method in ("GET", "DELETE"):
        foreign = stack.live.request(method, f"/v1/searches/{theirs}", headers=ACME)
        nobodys = stack.live.request(method, f"/v1/searches/{made_up}", headers=ACME)
        assert foreign.status_code == 404, foreign.text
        assert seen(foreign, theirs) == seen(nobodys, made_up)


def test_job_ids_say_nothing_of_who_made_them_or_how_many_came_between(stack: Stack) -> None:
    """Ids are random (a UUID4's 122 bits), so one tenant's next id neither counts nor dates
    the jobs another made meanwhile, nor names a tenant or an index: no two ids of the two
    tenants' interleaved jobs share their first or last 8 hex digits, as ids from a counter,
    a clock or a host (UUID1) would."""
    ids = []
    for n in range(8):
        for who in (ACME, GLOBEX):
            made = [
                stack.idle.post(
                    "/v1/searches", json={"index": INDEX, "query": f"q{n}"}, headers=who
                ),
                stack.idle.post(
                    "/v1/batches",
                    json={"index": INDEX, "queries": [{"id": "q", "query": f"q{n}"}]},
                    headers=who,
                ),
                stack.idle.post(
                    f"/v1/indexes/{INDEX}/documents",
                    json={"documents": [{"id": f"d{n}", "text": "hello"}]},
                    headers=who,
                ),
            ]
            for response in made:
                assert response.status_code == 202, response.text
                ids.append(str(response.json()["id"]))
    hexes = [job_id.split("_", 1)[1] for job_id in ids]
    assert all(len(h) == 32 and int(h, 16) >= 0 for h in hexes)
    for part in (slice(0, 8), slice(-8, None)):
        assert len({h[part] for h in hexes}) == len(hexes), part
