"""A request that made a job answers with that job, even when Redis goes away right after.

The gateway reaches Redis through :class:`~tests.reliability.replyloss.ReplyLoss`, armed to
play a Redis restart at the first read the request makes once its job is written (the
``?wait=`` poll of a search or an ingest, a batch's read-back) and to stay down past the
request. The job exists, so the answer must be that job (``202`` with its id and
``Location``): a ``503`` "retry after 1 s" had the client send the request again, with no
``Idempotency-Key`` to tie the two, and make a second job (a second search's model call, a
second ingest or drop, a second batch). No worker runs: the jobs stay queued.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import redis

from tests.reliability.replyloss import ReplyLoss
from tests.reliability.support import ACME, INDEX, KEYS
from tests.services import gateway, redis_server
from worker.constants import BATCH_KEY, IDEMPOTENCY_KEY, INGEST_KEY, SEARCH_KEY
from worker.queue.jobstore.scripts import _READ_JOBS

# a job's read whole (its record and its webhook owed), one script run by its SHA
READ_JOB = hashlib.sha1(_READ_JOBS.encode()).hexdigest().encode()

pytestmark = pytest.mark.integration

# longer than each request takes with Redis away (its wait, and its reads' retries)
OUTAGE_SECONDS = 60.0


class Case(NamedTuple):
    send: Callable[[httpx.Client], httpx.Response]
    markers: tuple[bytes, ...]  # the first read of the job, once written
    prefix: str  # its record's key prefix
    location: str


CASES = {
    "a search's wait": Case(
        lambda c: c.post(
            "/v1/searches", params={"wait": 2}, json={"index": INDEX, "query": "tea"}, headers=ACME
        ),
        (b"$4\r\nHGET\r\n", SEARCH_KEY.encode(), b"\r\nstatus\r\n"),
        SEARCH_KEY,
        "/v1/searches/",
    ),
    "an ingest's wait": Case(
        lambda c: c.post(
            f"/v1/indexes/{INDEX}/documents",
            params={"wait": 2},
            json={"documents": [{"id": "d1", "text": "green tea"}]},
            headers=ACME,
        ),
        (b"HGETALL", INGEST_KEY.encode()),
        INGEST_KEY,
        "/v1/ingestions/",
    ),
    "a batch's read-back": Case(
        lambda c: c.post(
            "/v1/batches",
            json={"index": INDEX, "queries": [{"id": "1", "query": "tea"}]},
            headers=ACME,
        ),
        (READ_JOB, BATCH_KEY.encode()),
        BATCH_KEY,
        "/v1/batches/",
    ),
}


class Outage(NamedTuple):
    client: httpx.Client
    proxy: ReplyLoss
    direct: redis.Redis


@pytest.fixture
def outage(tmp_path: Path) -> Iterator[Outage]:
    """redis-server (AOF everysec, as ``sift up`` runs it), the proxy, the gateway through it
    at its defaults, and a client of Redis's own (not through the proxy)."""
    with (
        redis_server(tmp_path / "redis", appendonly=True) as url,
        ReplyLoss(int(url.rsplit(":", 1)[1])) as proxy,
    ):
        env = {"SIFT_REDIS_URL": proxy.url + "/0", "SIFT_API_KEYS": json.dumps(KEYS)}
        direct = redis.Redis.from_url(url + "/0", decode_responses=True)
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=120) as client,
        ):
            try:
                yield Outage(client, proxy, direct)
            finally:
                direct.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_a_job_made_before_redis_went_away_is_answered_not_503(outage: Outage, name: str) -> None:
    case = CASES[name]
    outage.proxy.arm(*case.markers, outage=OUTAGE_SECONDS)
    response = case.send(outage.client)
    assert outage.proxy.fired.is_set(), "Redis never went away"
    jobs = [k.removeprefix(case.prefix) for k in outage.direct.scan_iter(case.prefix + "*")]
    assert len(jobs) == 1, jobs  # the request made its job, once
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["id"] == jobs[0]
    assert body["status"] == "queued"
    assert response.headers["location"] == case.location + jobs[0]


# what a batch's or an ingest's commit carries: a batch's MULTI, an ingest's script call (it
# takes the write version and dates the job in one step), and its record's key
COMMITS = {
    "a batch": (CASES["a batch's read-back"], (b"MULTI", BATCH_KEY.encode())),
    "an ingest": (CASES["an ingest's wait"], (b"EVALSHA", INGEST_KEY.encode())),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("down", [0.0, 2.0], ids=["a blip", "then away 2 s"])
@pytest.mark.parametrize("name", list(COMMITS))
def test_a_job_whose_commit_reply_was_lost_is_answered_once(
    outage: Outage, name: str, down: float
) -> None:
    """The commit (one MULTI, an ingest's one script: the record, its task messages) ran and
    its reply was lost with the connection (a network blip at that instant; or a Redis
    restart, away for ``down`` seconds after). Sent again once Redis answers, it finds its
    record and writes nothing twice; the answer is the one job (a 503 had the client send the
    request again: a second job)."""
    case, markers = COMMITS[name]
    outage.proxy.arm(*markers, down_after=down)
    response = case.send(outage.client)
    assert outage.proxy.fired.is_set(), "no reply was lost"
    jobs = [k.removeprefix(case.prefix) for k in outage.direct.scan_iter(case.prefix + "*")]
    assert len(jobs) == 1, jobs
    assert response.status_code in (200, 202), response.text
    assert response.json()["id"] == jobs[0]


@pytest.mark.timeout(180)
def test_a_search_whose_create_reply_was_lost_with_redis_then_away_is_answered_once(
    outage: Outage,
) -> None:
    """The search's create script ran, its reply was lost, and Redis was then away for a
    moment (a restart just after the write: ``down_after``). The script is safe to send
    again (it does nothing when its record exists), so it is sent again until Redis
    answers, as a cancel is, for a few seconds: the answer is the one search. It was tried
    once more after 50 ms, then a 503 for a search that existed."""
    case = CASES["a search's wait"]
    outage.proxy.arm(b"EVALSHA", SEARCH_KEY.encode(), down_after=2.0)
    response = outage.client.post(
        "/v1/searches", json={"index": INDEX, "query": "tea"}, headers=ACME
    )
    assert outage.proxy.fired.is_set(), "no reply was lost"
    jobs = [k.removeprefix(case.prefix) for k in outage.direct.scan_iter(case.prefix + "*")]
    assert len(jobs) == 1, jobs
    assert response.status_code == 202, response.text
    assert response.json()["id"] == jobs[0]


@pytest.mark.timeout(180)
def test_a_batch_whose_items_redis_lost_before_its_commit_is_not_made(outage: Outage) -> None:
    """Redis restarted empty (no persistence) between the batch's items and its commit: the
    commit, sent again once Redis answers, must not make a batch with no items (it would stay
    ``queued`` forever, its chunks finding nothing to run); the request is a 503, and no
    batch exists."""
    case = CASES["a batch's read-back"]
    outage.proxy.arm(b"MULTI", BATCH_KEY.encode(), outage=2.0)
    wiped = threading.Thread(target=lambda: outage.proxy.fired.wait(60) and outage.direct.flushdb())
    wiped.start()
    response = case.send(outage.client)
    wiped.join()
    assert outage.proxy.fired.is_set(), "Redis never went away"
    assert list(outage.direct.scan_iter(BATCH_KEY + "*")) == []
    assert response.status_code == 503, response.text


@pytest.mark.timeout(180)
@pytest.mark.parametrize("down", [0.0, 2.0], ids=["a blip", "then away 2 s"])
def test_a_key_whose_claim_reply_was_lost_makes_its_job(outage: Outage, down: float) -> None:
    """The Idempotency-Key's claim ran and its reply was lost (a blip, or a Redis restart
    just after it). Sent again, the claim finds its own marker and goes on: the request makes
    its one job, and the key is bound to it. It was a 503, and every resend of the key a 409
    ``idempotency_key_in_progress`` until the marker expired, 120 s later."""
    headers = {**ACME, "Idempotency-Key": "claim-lost-1"}
    body = {"index": INDEX, "query": "tea"}
    outage.proxy.arm(b"EVALSHA", IDEMPOTENCY_KEY.encode(), b"pending", down_after=down)
    response = outage.client.post("/v1/searches", json=body, headers=headers)
    assert outage.proxy.fired.is_set(), "no reply was lost"
    assert response.status_code == 202, response.text
    again = outage.client.post("/v1/searches", json=body, headers=headers)
    assert again.status_code == 202, again.text
    assert again.json()["id"] == response.json()["id"]
    assert len(list(outage.direct.scan_iter(SEARCH_KEY + "*"))) == 1


# each case's request, waiting longer than the outage (2 s) lasts
WAITING = {
    "a search's wait": lambda c: c.post(
        "/v1/searches", params={"wait": 20}, json={"index": INDEX, "query": "tea"}, headers=ACME
    ),
    "an ingest's wait": lambda c: c.post(
        f"/v1/indexes/{INDEX}/documents",
        params={"wait": 20},
        json={"documents": [{"id": "d1", "text": "green tea"}]},
        headers=ACME,
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(WAITING))
def test_a_job_redis_lost_while_its_request_waited_is_a_503(outage: Outage, name: str) -> None:
    """Redis restarted empty (no persistence) while the request waited on the job it made:
    the poll reads on through the outage and then finds no record, so the job is lost (its
    task message with it) and nothing will run it. The answer must say so (a 503: retry,
    which makes the one job), not 202 ``queued`` with a ``Location`` that is a 404 (the
    ingest's), nor a 404 naming an ``id`` the client never sent (the search's)."""
    case = CASES[name]
    outage.proxy.arm(*case.markers, outage=2.0)
    wiped = threading.Thread(target=lambda: outage.proxy.fired.wait(60) and outage.direct.flushdb())
    wiped.start()
    response = WAITING[name](outage.client)
    wiped.join()
    assert outage.proxy.fired.is_set(), "Redis never went away"
    assert list(outage.direct.scan_iter(case.prefix + "*")) == []
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seen", ["running", "succeeded"])
def test_a_searchs_outage_202_says_the_status_its_wait_read(outage: Outage, seen: str) -> None:
    """The search's ``?wait=`` poll read the job ``running`` (or ``succeeded``: a worker just
    finished it), then Redis went away at the read of the whole record: the ``202`` said
    ``queued`` whatever the poll had read. It says the last status read now; a ``202`` is
    never final, so one saying ``succeeded`` has no ``result`` for its ``Location`` to give."""
    outage.proxy.arm(READ_JOB, SEARCH_KEY.encode(), outage=OUTAGE_SECONDS)
    stop = threading.Event()

    def move() -> None:  # a worker's move, while the request polls the status
        while not stop.is_set():
            for key in outage.direct.scan_iter(SEARCH_KEY + "*"):
                outage.direct.hset(key, "status", seen)
                return
            stop.wait(0.005)

    mover = threading.Thread(target=move)
    mover.start()
    try:
        response = CASES["a search's wait"].send(outage.client)
    finally:
        stop.set()
        mover.join()
    assert outage.proxy.fired.is_set(), "Redis never went away"
    (key,) = outage.direct.scan_iter(SEARCH_KEY + "*")
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["id"] == key.removeprefix(SEARCH_KEY)
    assert body["status"] == seen and body["result"] is None
    assert response.headers["location"] == "/v1/searches/" + body["id"]


@pytest.mark.timeout(180)
def test_a_batch_redis_lost_before_its_read_back_is_a_503(outage: Outage) -> None:
    """Redis back empty (no persistence) between a batch's commit and its read-back: the
    read-back found no record, and the request was a ``404`` naming an ``id`` the client
    never sent. The batch is lost (its chunk messages with it): a ``503``, "send the request
    again", as a search's or an ingest's lost while its ``?wait=`` polled."""
    case = CASES["a batch's read-back"]
    outage.proxy.arm(*case.markers, before=outage.direct.flushdb)
    response = case.send(outage.client)
    assert outage.proxy.fired.is_set(), "Redis never went away"
    assert list(outage.direct.scan_iter(case.prefix + "*")) == []
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert "lost this batch" in response.json()["error"]["message"]
