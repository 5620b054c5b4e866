"""A Redis at its ``maxmemory`` (``noeviction``, as every Redis Sift runs is set: the
compose file and ``sift up`` give it a limit) refuses every write that would grow it, with
``OOM command not allowed``. The gateway answers that as a passing state: ``503``
``job_store_full`` naming what to free, nothing stored; what is stored still reads. It was a
``500 internal_error``, logged as the gateway's bug. Its type is not ``unavailable`` (Redis
down, restarting or not answering in time, after which a write may or may not have been
made): a client may send a request refused ``job_store_full`` again, a delete too, knowing
the first did nothing."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator

import pytest
import redis
from starlette.testclient import TestClient

from api_gateway.app import create_app
from api_gateway.backpressure import READ_EVERY_SECONDS
from tests.integration.gateway_app import ACME, gateway_settings
from tests.services import unable_to_persist
from worker.constants import STATS_KEY
from worker.contract import SearchSpec
from worker.queue.jobstore import JobStore

SEARCH = {"index": "docs", "query": "tea"}


@pytest.fixture
def full(store: JobStore) -> Iterator[None]:
    """The server's memory limit set below what it holds: every growing write is refused."""
    used = int(store.redis.info("memory")["used_memory"])
    store.redis.config_set("maxmemory", used // 2)
    yield
    store.redis.config_set("maxmemory", 0)


def test_a_full_job_store_is_a_503_naming_its_memory_and_stores_nothing(
    client: TestClient, store: JobStore, full: None
) -> None:
    del full
    searches = client.get("/v1/searches", headers=ACME).json()["searches"]
    for path, body, headers in [
        ("/v1/searches", SEARCH, ACME),
        ("/v1/batches", {"index": "docs", "queries": [{"id": "a", "query": "tea"}]}, ACME),
        ("/v1/searches", SEARCH, {**ACME, "Idempotency-Key": "k1"}),
        ("/v1/indexes/docs/documents/delete", {"ids": ["d"]}, ACME),
    ]:
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "job_store_full", error
        assert "nothing was stored" in error["message"], error
        assert "maxmemory" in error["message"], error
        assert "SIFT_RESULT_RETENTION_SECONDS" in error["message"], error
        assert response.headers["retry-after"]
    assert client.get("/v1/searches", headers=ACME).json()["searches"] == searches
    assert client.get("/v1/ingestions", headers=ACME).json()["ingestions"] == []


@pytest.fixture
def cannot_persist(store: JobStore) -> Iterator[None]:
    """The server refusing every write with ``MISCONF``, as when its disk is full, until set
    back after the test (:func:`tests.services.unable_to_persist`)."""
    with unable_to_persist(store.redis):
        yield


def test_a_job_store_that_cannot_persist_to_its_disk_is_a_503_naming_it(
    client: TestClient, store: JobStore, cannot_persist: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis whose AOF disk is full refuses every write with ``MISCONF`` (a plain
    ResponseError to redis-py), the whole of a job's MULTI: nothing stored, as at its
    maxmemory, and the disk's room comes back as the operator frees it. It was a ``500
    internal_error`` with no Retry-After, logged as the gateway's bug (/tmp/exhaust17's p5)."""
    del cannot_persist
    with pytest.raises(redis.ResponseError, match=r"^MISCONF"):
        store.redis.set("probe", "1")  # the refusal is real
    keys = sorted(store.redis.keys())  # a read Redis still answers (a PING it refuses too)
    for path, body, headers in [
        ("/v1/searches", SEARCH, ACME),
        ("/v1/batches", {"index": "docs", "queries": [{"id": "a", "query": "tea"}]}, ACME),
        ("/v1/indexes/docs/documents", {"documents": [{"id": "d", "text": "tea"}]}, ACME),
        ("/v1/indexes/docs/documents/delete", {"ids": ["d"]}, ACME),
    ]:
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 503, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "job_store_full", error
        assert "nothing was stored" in error["message"], error
        assert "disk" in error["message"] and "maxmemory" not in error["message"], error
        assert response.headers["retry-after"] == "30", response.headers
    assert "Traceback" not in caplog.text and "job store error" not in caplog.text, caplog.text
    assert sorted(store.redis.keys()) == keys


def test_what_was_stored_before_it_filled_still_reads(client: TestClient, store: JobStore) -> None:
    made = client.post("/v1/searches", json=SEARCH, headers=ACME)
    assert made.status_code == 202, made.text
    used = int(store.redis.info("memory")["used_memory"])
    store.redis.config_set("maxmemory", used // 2)
    try:
        read = client.get(f"/v1/searches/{made.json()['id']}", headers=ACME)
    finally:
        store.redis.config_set("maxmemory", 0)
    assert read.status_code == 200 and read.json()["status"] == "queued", read.text


@pytest.fixture
def nearly_full(store: JobStore) -> Iterator[None]:
    """The server's memory limit set so what it holds is 93 % of it: past the gateway's 90 %
    for new jobs, a megabyte and more under the limit itself (20 MB held)."""
    # SETRANGE grows the value inside the server: a SET of 20 MB would leave its 20 MB query
    # buffer counted in used_memory until the server's cron frees it, a limit read then twice
    # too high, and the gateway's reading a moment later under its 90 % (a CI failure).
    store.redis.setrange("ballast", 20_000_000 - 1, b"x")
    used = int(store.redis.info("memory")["used_memory"])
    store.redis.config_set("maxmemory", int(used / 0.93))
    yield
    store.redis.config_set("maxmemory", 0)
    store.redis.delete("ballast")


def test_new_jobs_are_refused_before_the_job_store_is_full_so_running_ones_can_end(
    client: TestClient, store: JobStore, nearly_full: None
) -> None:
    """At Redis's maxmemory the workers' own writes are refused too (a result, a move, a
    heartbeat): the jobs already queued could not end. So the gateway refuses new work
    (searches, batches, documents) at 90 % of it, and the room left is for the jobs running;
    a delete, which frees room, is still taken."""
    del nearly_full
    for path, body in [
        ("/v1/searches", SEARCH),
        ("/v1/batches", {"index": "docs", "queries": [{"id": "a", "query": "tea"}]}),
        ("/v1/indexes/docs/documents", {"documents": [{"id": "d", "text": "tea"}]}),
    ]:
        response = client.post(path, json=body, headers=ACME)
        assert response.status_code == 503, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "job_store_full", error
        message = error["message"]
        assert "past 90%" in message and "maxmemory" in message, message
        assert "nothing was stored" in message and response.headers["retry-after"], message
        assert "Redis holds" not in message, message  # every tenant's work: the log's alone
    deleted = client.delete("/v1/indexes/docs/documents/d", headers=ACME)
    assert deleted.status_code == 202, deleted.text
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"))
    assert store.start_search(job.id)  # a worker's writes still go through


def test_a_redis_that_refuses_info_admits_by_nothing_else(redis_url: str, store: JobStore) -> None:
    """A Redis whose ACL refuses ``INFO`` (a managed service's user): the memory check
    is off, said once, and jobs are still taken (every submission was a 500 otherwise)."""
    store.redis.execute_command(
        "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info"
    )
    try:
        host = redis_url.removeprefix("redis://")
        settings = gateway_settings(f"redis://noinfo:pw@{host}")
        with TestClient(create_app(settings)) as client:
            made = client.post("/v1/searches", json=SEARCH, headers=ACME)
    finally:
        store.redis.execute_command("ACL", "DELUSER", "noinfo")
    assert made.status_code == 202, made.text


def test_the_openapi_document_tells_the_two_503s_apart(client: TestClient) -> None:
    """A client reads from the type whether a refused request may have been applied: the
    OpenAPI document's 503 names both types and says which stored nothing."""
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in [
        ("/v1/searches", "post"),
        ("/v1/batches", "post"),
        ("/v1/indexes/{index}/documents/delete", "post"),
        ("/v1/indexes/{index}", "delete"),
    ]:
        said = paths[path][method]["responses"]["503"]["description"]
        assert "`unavailable`" in said and "`job_store_full`" in said, (path, said)
        assert "nothing was stored" in said, (path, said)


@pytest.fixture
def four_fifths_full(store: JobStore) -> Iterator[int]:
    """The server's memory limit set so what it holds is 80 % of it (20 MB held), under the
    gateway's 90 % for new jobs; yields the limit."""
    store.redis.setrange("ballast", 20_000_000 - 1, b"x")  # grown in place: see nearly_full
    limit = int(int(store.redis.info("memory")["used_memory"]) / 0.8)
    store.redis.config_set("maxmemory", limit)
    yield limit
    store.redis.config_set("maxmemory", 0)
    store.redis.delete("ballast")


def _batch_of(n: int, prefix: str) -> dict[str, object]:
    return {"index": "docs", "queries": [{"id": f"{prefix}{i}", "query": "tea"} for i in range(n)]}


def test_a_batch_whose_own_results_would_fill_the_job_store_is_refused_whole(
    client: TestClient, store: JobStore, four_fifths_full: int
) -> None:
    """Admission read Redis's memory as it stood, not what the batch would add: at 80 % of
    maxmemory a batch whose items and results take more than the room left was taken, and
    it filled Redis: its items' writes were refused, and the worker's broker writes (a
    message taken, its ack), which stopped the worker, the batch left unfinished. The
    batch's own bytes are counted now: one that would take Redis past 90 % is refused whole,
    naming what it would add; one that fits is still taken. One that alone would pass the
    90 % is a 422 naming its queries: no retry admits it."""
    limit = four_fifths_full
    room = int(0.1 * limit)  # from 80 % to the 90 % new jobs are refused past
    # some 5.75 kB an item of 10 hits: more than the room, and an eighth of it
    too_large, fits = room // 1_000, room // 46_000
    keys = sorted(store.redis.keys())
    refused = client.post("/v1/batches", json=_batch_of(too_large, "big"), headers=ACME)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["type"] == "job_store_full", error
    message = error["message"]
    assert f"this batch of {too_large} queries" in message and "past 90%" in message, message
    assert "nothing was stored" in message and "SIFT_RESULT_RETENTION_SECONDS" in message
    assert refused.headers["retry-after"] == "30", refused.headers
    assert sorted(store.redis.keys()) == keys
    taken = client.post("/v1/batches", json=_batch_of(fits, "small"), headers=ACME)
    assert taken.status_code == 202, taken.text
    never = int(0.9 * limit) // 4_000
    refused = client.post("/v1/batches", json=_batch_of(never, "huge"), headers=ACME)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == "queries", error
    assert "no retry admits it" in error["message"], error


def test_a_refusal_tells_the_tenant_nothing_of_what_redis_holds(
    client: TestClient, store: JobStore, four_fifths_full: int, caplog: pytest.LogCaptureFixture
) -> None:
    """What Redis holds, with the results owed, is every tenant's work, and a ``503
    job_store_full`` said it ("Redis holds 80% of its maxmemory, with the results owed (25.0
    MB)"): with one other tenant busy, the caller read that tenant's volume in it, as the
    backlog's 429 no longer lets it. The refusal names what the caller's own job would add
    and the 90 % line; what Redis holds goes to the log, for the operator."""
    room = int(0.1 * four_fifths_full)
    caplog.set_level(logging.WARNING, logger="api_gateway")
    refused = client.post("/v1/batches", json=_batch_of(room // 1_000, "big"), headers=ACME)
    assert refused.status_code == 503, refused.text
    message = refused.json()["error"]["message"]
    assert "Redis holds" not in message and "owed" not in message, message
    assert "this batch of" in message and "it would add about" in message, message
    assert "past 90% of Redis's maxmemory" in message, message
    logged = re.search(r"Redis holds (\d+)% of its maxmemory, with the results owed", caplog.text)
    assert logged and 79 <= int(logged[1]) < 90, caplog.text


def test_the_results_owed_to_batches_admitted_before_count_against_the_next(
    client: TestClient, store: JobStore, four_fifths_full: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Each batch was judged with its own results, but those of the batches admitted before
    it were forgotten at the next reading of Redis's memory (0.5 s later), which holds their
    items, not the results they will write: batches sent one after another at 80 % each
    passed, and together filled Redis. The items queued or running are counted with what
    they owe: of two batches that each fit the room left, the second, sent after a new
    reading, is refused."""
    each = int(0.06 * four_fifths_full) // 5_750  # six hundredths of maxmemory: one fits
    first = client.post("/v1/batches", json=_batch_of(each, "one"), headers=ACME)
    assert first.status_code == 202, first.text
    time.sleep(READ_EVERY_SECONDS + 0.2)  # the memory read again: not a speed check
    second = client.post("/v1/batches", json=_batch_of(each, "two"), headers=ACME)
    assert second.status_code == 503, second.text
    assert second.json()["error"]["type"] == "job_store_full", second.text
    assert "with the results owed" in caplog.text, caplog.text  # the log's, not the tenant's


def test_the_results_owed_to_batches_over_long_documents_count_as_they_were_priced(
    client: TestClient, store: JobStore, four_fifths_full: int, caplog: pytest.LogCaptureFixture
) -> None:
    """What the work admitted before still owes was counted at 4.6 kB an item, whatever its
    index, where a batch is priced by its index's mean document: batches over long documents
    sent one after another each passed, counted at a hundredth of their size once admitted,
    and their results filled Redis together. Each job's price is owed, from its admission
    until its items end: of two batches over documents whose hits fill three tenths of the
    room left each, the second, sent after a new reading, is refused before anything is
    written; once the first is canceled it owes nothing, and the second is taken."""
    room = int(0.1 * four_fifths_full)  # from 80 % to the 90 % new jobs are refused past
    store.record_index_size("acme", "long", 50, 50 * (room * 3 // 100))  # as a worker would
    body = {"index": "long", "queries": [{"id": f"q{i}", "query": "tea"} for i in range(2)]}
    first = client.post("/v1/batches", json=body, headers=ACME)
    assert first.status_code == 202, first.text
    time.sleep(READ_EVERY_SECONDS + 0.2)  # the memory read again: not a speed check
    keys = sorted(store.redis.keys())
    owed = store.redis.hget(STATS_KEY, "owed_bytes")
    second = client.post("/v1/batches", json=body, headers=ACME)
    assert second.status_code == 503, second.text
    error = second.json()["error"]
    assert error["type"] == "job_store_full", error
    assert "index 'long'" in error["message"] and "with the results owed" in caplog.text
    assert sorted(store.redis.keys()) == keys
    assert store.redis.hget(STATS_KEY, "owed_bytes") == owed
    canceled = client.delete(f"/v1/batches/{first.json()['id']}", headers=ACME)
    assert canceled.status_code == 200, canceled.text
    assert store.redis.hget(STATS_KEY, "owed_bytes") is None  # nothing queued: none owed
    time.sleep(READ_EVERY_SECONDS + 0.2)
    taken = client.post("/v1/batches", json=body, headers=ACME)
    assert taken.status_code == 202, taken.text


def test_a_batch_s_results_still_read_on_a_full_job_store(
    client: TestClient, store: JobStore
) -> None:
    """Redis at its maxmemory refuses every command queued in a ``MULTI``, reads too, and a
    page of a batch's results was read in one: a ``503`` where a client reading its results
    (to erase the batch after, and free room) should have them."""
    made = client.post("/v1/batches", json=_batch_of(3, "r"), headers=ACME)
    assert made.status_code == 202, made.text
    batch_id = made.json()["id"]
    used = int(store.redis.info("memory")["used_memory"])
    store.redis.config_set("maxmemory", used // 2)
    try:
        read = client.get(f"/v1/batches/{batch_id}/results", headers=ACME)
    finally:
        store.redis.config_set("maxmemory", 0)
    assert read.status_code == 200, read.text
    lines = read.json()["results"]
    assert [(line["query_id"], line["status"]) for line in lines] == [
        ("r0", "queued"),
        ("r1", "queued"),
        ("r2", "queued"),
    ], lines


def test_an_ingest_whose_documents_would_fill_the_job_store_is_refused(
    client: TestClient, store: JobStore
) -> None:
    """An ingest's documents wait in Redis for a worker, up to 32 MB a request, and were
    priced at nothing: at 85 % of maxmemory an ingest of 6 % of it was taken, past the 90 %
    kept for the jobs running (several at once reach maxmemory, where the workers' writes
    are refused). Its bytes are counted now: one that would pass the 90 % is refused, nothing
    stored, its message saying what the bytes are; a smaller one is still taken."""
    store.redis.setrange("ballast", 20_000_000 - 1, b"x")  # grown in place: see nearly_full
    limit = int(int(store.redis.info("memory")["used_memory"]) / 0.85)
    store.redis.config_set("maxmemory", limit)

    def ingest(size: int) -> dict[str, object]:
        count = -(-size // 90_000)
        return {"documents": [{"id": f"d{i}", "text": "x" * 90_000} for i in range(count)]}

    try:
        keys = sorted(store.redis.keys())
        refused = client.post(
            "/v1/indexes/docs/documents", json=ingest(limit * 6 // 100), headers=ACME
        )
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "job_store_full", error
        assert "this ingest of" in error["message"] and "past 90%" in error["message"], error
        assert "as its documents wait for a worker" in error["message"], error  # no results
        assert sorted(store.redis.keys()) == keys
        taken = client.post("/v1/indexes/docs/documents", json=ingest(limit // 50), headers=ACME)
        assert taken.status_code == 202, taken.text
    finally:
        store.redis.config_set("maxmemory", 0)
        store.redis.delete("ballast")
