"""Backpressure: past ``SIFT_MAX_BACKLOG`` queued items the gateway answers 429 with
``Retry-After`` and a JSON error naming the limit; a batch that would pass it is refused
whole. The gateway's queue has no worker (the e2e ``idle`` pattern), so the backlog only grows.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from api_gateway.backpressure import READ_EVERY_SECONDS, hit_bytes, results_bytes
from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    INDEX,
    Receiver,
    batch_counts,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker, gateway, redis_server
from worker.constants import (
    BATCH_KEY,
    BATCH_RESULTS_KEY,
    ECONOMY_PREPARED_KEY,
    INDEX_SIZE_KEY,
    SEARCH_KEY,
    STATS_KEY,
)
from worker.queue.jobstore import AsyncJobStore

pytestmark = pytest.mark.integration

LIMIT = 5


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, str]]:
    tmp = Path(tmp_path_factory.mktemp("backpressure"))
    with redis_server(tmp / "redis") as url:
        env = stack_env(url + "/0", "http://127.0.0.1:9", SIFT_MAX_BACKLOG=str(LIMIT))
        with gateway(tmp / "g", env) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield client, url + "/0"


def _batch(n: int, prefix: str) -> dict[str, object]:
    return {"index": INDEX, "queries": [{"id": f"{prefix}{i}", "query": "tea"} for i in range(n)]}


def _queued(url: str) -> int:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return int(client.hget(STATS_KEY, "queued") or 0)
    finally:
        client.close()


def test_past_the_backlog_limit_new_work_gets_429_with_retry_after(
    idle: tuple[httpx.Client, str],
) -> None:
    client, url = idle
    accepted = client.post("/v1/batches", json=_batch(3, "a"), headers=ACME)
    assert accepted.status_code == 202, accepted.text
    for i in range(2):
        search = client.post("/v1/searches", json={"index": INDEX, "query": f"q{i}"}, headers=ACME)
        assert search.status_code == 202, search.text
    assert _queued(url) == LIMIT

    refused = client.post("/v1/searches", json={"index": INDEX, "query": "one more"}, headers=ACME)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) > 0
    error = refused.json()["error"]
    assert error["type"] == "backlog_full"
    assert "SIFT_MAX_BACKLOG" in error["message"] and str(LIMIT) in error["message"]

    whole = client.post("/v1/batches", json=_batch(2, "b"), headers=ACME)
    assert whole.status_code == 429 and whole.json()["error"]["type"] == "backlog_full"
    assert _queued(url) == LIMIT  # nothing of the refused batch was stored or queued


def test_two_gateways_on_one_redis_admit_no_more_than_the_limit_together(tmp_path: Path) -> None:
    """The limit is the fleet's, whichever gateway a request reaches: each gateway admitted on
    a reading of its own, cached half a second, so two batches of 6 sent at once to two
    gateways both got in under a limit of 10 (three of 15, to three, all got in under 20)."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", "http://127.0.0.1:9", SIFT_MAX_BACKLOG="10")
        with (
            gateway(tmp_path / "a", env, name="a") as a_url,
            gateway(tmp_path / "b", env, name="b") as b_url,
            httpx.Client(base_url=a_url, timeout=30) as a,
            httpx.Client(base_url=b_url, timeout=30) as b,
            ThreadPoolExecutor(2) as pool,
        ):
            sent = [pool.submit(c.post, "/v1/batches", json=_batch(6, n), headers=ACME)
                    for c, n in ((a, "a"), (b, "b"))]  # fmt: skip
            assert sorted(f.result().status_code for f in sent) == [202, 429]
            assert _queued(url + "/0") == 6
            # one after another, each gateway's view fresh: 7, then 10, then none more
            search = {"index": INDEX, "query": "tea"}
            assert b.post("/v1/searches", json=search, headers=ACME).status_code == 202
            assert a.post("/v1/batches", json=_batch(3, "c"), headers=ACME).status_code == 202
            refused = b.post("/v1/searches", json=search, headers=ACME)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "backlog_full"
            assert _queued(url + "/0") == 10


def test_a_batch_larger_than_what_is_left_is_refused_whole(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", "http://127.0.0.1:9", SIFT_MAX_BACKLOG="10")
        with gateway(tmp_path / "g", env) as base, httpx.Client(base_url=base, timeout=30) as c:
            assert c.post("/v1/batches", json=_batch(8, "a"), headers=ACME).status_code == 202
            refused = c.post("/v1/batches", json=_batch(3, "b"), headers=ACME)
            assert refused.status_code == 429, refused.text
            # the queued count (8) is every tenant's work: the caller is not told it
            message = refused.json()["error"]["message"]
            assert "3 more" in message and "limit of 10" in message
            assert "8" not in message, message
            assert _queued(url + "/0") == 8  # not 10: no half-accepted batch
            assert c.post("/v1/batches", json=_batch(2, "c"), headers=ACME).status_code == 202
            assert _queued(url + "/0") == 10


def _hold(url: str, token: str, items: int, seconds: float) -> int | None:
    """As a gateway storing a job does: hold ``items`` under ``token`` for ``seconds`` (a
    limit of 10); with ``seconds`` 0, drop the hold."""

    async def run() -> int | None:
        store = AsyncJobStore.from_url(url)
        try:
            if not seconds:
                await store.release_backlog(token)
                return None
            return await store.hold_backlog(token, items, 10, seconds)
        finally:
            await store.close()

    return asyncio.run(run())


def test_a_batch_another_gateway_is_storing_counts_against_the_limit_until_its_hold_ends(
    tmp_path: Path,
) -> None:
    """The store counts a batch's items only once its commit is written (after its items are
    staged, slice by slice); until then the gateway storing it holds their room in Redis,
    where every gateway's admission reads it. A hold of 8 (a gateway storing a batch of 8)
    refuses a batch of 3 under a limit of 10; dropped, the batch is admitted; and one its
    gateway died with lapses on its own."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", "http://127.0.0.1:9", SIFT_MAX_BACKLOG="10")
        with gateway(tmp_path / "g", env) as base, httpx.Client(base_url=base, timeout=60) as c:

            def post(name: str) -> httpx.Response:
                return c.post("/v1/batches", json=_batch(3, name), headers=ACME)

            assert _hold(url + "/0", "storing", 8, 600.0) is None
            refused = post("a")
            assert refused.status_code == 429, refused.text
            assert _queued(url + "/0") == 0
            _hold(url + "/0", "storing", 0, 0.0)
            assert post("b").status_code == 202
            # a dead gateway's hold of 7, with 3 queued: refused until it lapses
            assert _hold(url + "/0", "dead", 7, 1.0) is None
            assert post("c").status_code == 429
            time.sleep(1.2)
            assert post("d").status_code == 202
            assert _queued(url + "/0") == 6


def test_a_batch_being_stored_counts_against_redis_s_memory_in_a_reading_taken_meanwhile(
    tmp_path: Path,
) -> None:
    """Redis's memory as the backlog's count (the test above): a batch's price is owed in
    the store (``owed_bytes``) only once its commit is written, and a reading of Redis's
    memory due between its admission and its commit dropped it. Redis at 80 % of its
    maxmemory, two batches that each take six hundredths of it: with the first's writes held
    up (Redis paused for writes: reads still answered), the second, sent after the reading
    fell due, was admitted too, and the two came to 92 %, past the 90 % new jobs are refused
    past. The second is refused now, nothing of it stored."""
    with redis_server(tmp_path / "redis") as base:
        url = base + "/0"
        env = stack_env(url, "http://127.0.0.1:9")
        with (
            gateway(tmp_path / "g", env) as gw,
            httpx.Client(base_url=gw, timeout=60) as c,
            redis.Redis.from_url(url) as r,
            ThreadPoolExecutor(2) as pool,
        ):
            r.setrange("ballast", 8_000_000 - 1, b"x")  # grown in place: see test_redis_full
            limit = int(int(r.info("memory")["used_memory"]) / 0.8)
            r.config_set("maxmemory", limit)
            each = int(0.06 * limit) // results_bytes(1, 10)  # 10 hits a query
            time.sleep(READ_EVERY_SECONDS)  # the first request takes a new reading

            def held() -> int:
                return int(r.info("clients")["blocked_clients"])  # paused writers count in

            r.execute_command("CLIENT", "PAUSE", 600_000, "WRITE")  # until UNPAUSE
            try:
                first = pool.submit(c.post, "/v1/batches", json=_batch(each, "a"), headers=ACME)
                wait_for(lambda: held() == 1, "the first batch, admitted, held at its first write")
                time.sleep(READ_EVERY_SECONDS)  # the next request takes a new reading
                second = pool.submit(c.post, "/v1/batches", json=_batch(each, "b"), headers=ACME)
                wait_for(lambda: second.done() or held() == 2, "the second answered or held")
            finally:
                r.execute_command("CLIENT", "UNPAUSE")
            assert first.result().status_code == 202, first.result().text
            refused = second.result()
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "job_store_full", refused.text
            assert _queued(url) == each


def test_the_openapi_document_lists_the_429(idle: tuple[httpx.Client, str]) -> None:
    client, _ = idle
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/searches", "/v1/batches"):
        busy = paths[path]["post"]["responses"]["429"]
        assert "Retry-After" in busy["headers"]


def test_a_batch_larger_than_the_whole_limit_is_422_not_a_429_to_retry(
    idle: tuple[httpx.Client, str],
) -> None:
    """A batch of more queries than ``SIFT_MAX_BACKLOG`` can never be admitted, even by an
    empty queue: its 429 said "retry after 5 s", and a client that honours ``Retry-After``
    retried it forever. It is a 422 naming ``queries`` and the size that fits, whatever is
    queued; and an Idempotency-Key it carried is free again."""
    client, url = idle
    before = _queued(url)
    headers = {**ACME, "Idempotency-Key": "too-big-1"}
    for _ in range(2):  # the same answer again: nothing was claimed or stored
        refused = client.post("/v1/batches", json=_batch(LIMIT + 1, "big"), headers=headers)
        assert refused.status_code == 422, refused.text
        assert "retry-after" not in refused.headers
        error = refused.json()["error"]
        assert error["type"] == "invalid_request" and error["field"] == "queries", error
        assert error["message"] == (
            f"queries: {LIMIT + 1} queries are more than the backlog holds "
            f"(SIFT_MAX_BACKLOG is {LIMIT}), so no retry admits them: send them in batches "
            f"of at most {LIMIT}"
        ), error
        assert _queued(url) == before


def test_a_batch_that_would_fill_redis_is_refused_and_one_that_fits_ends(
    tmp_path: Path, model: FakeAnthropic, receiver: Receiver
) -> None:
    """A real worker at the defaults, Redis (``noeviction``) at 80 % of its maxmemory. The
    gateway read only the memory held, so it took a batch whose results filled Redis: its
    items' writes were refused, the worker's broker writes too (a message taken, then its
    ack), which stopped the worker, and the batch stayed queued with nothing to run it. Its
    bytes are counted now: refused whole, with a 503 naming it; one that fits runs to its
    end, its counts and its webhook saying so."""
    with redis_server(tmp_path / "redis") as base, redis.Redis.from_url(base + "/0") as r:
        url = base + "/0"
        env = stack_env(url, model.url)
        with (
            gateway(tmp_path / "g", env) as gw,
            httpx.Client(base_url=gw, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w1") as worker,
        ):
            ingest(client)
            limit = 10_000_000
            _fill_to_80_percent(r, limit)
            # some 5.75 kB an item of 10 hits with its result: 430, more than twice the room
            # to 90 % (1 MB); 40, under a quarter of it
            refused = client.post("/v1/batches", json=_batch(430, "big"), headers=ACME)
            error = _store_full(refused)
            assert "this batch of 430 queries" in error["message"], error
            batch_id = submit_batch(client, 40, webhook_url=receiver.url)
            wait_for(
                lambda: batch_counts(client, batch_id)["counts"]["succeeded"] == 40,
                "the batch's end",
            )
            wait_for(lambda: receiver.for_job(batch_id), "the batch's webhook")
            done = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
            assert done["status"] == "succeeded", done
            assert receiver.for_job(batch_id)[0].body["data"]["status"] == "succeeded"
            assert worker.poll() is None  # the worker runs on
            assert int(r.info("memory")["used_memory"]) < limit


# a traced reranked search of 1 hit over 50 candidates of index "long"
TRACED_LONG = {
    "index": "long",
    "query": "chess kasparov",
    "limit": 1,
    "rerank": True,
    "include_trace": True,
    "candidate_limit": 50,
}


def _fill_to_80_percent(r: redis.Redis, limit: int) -> None:
    """Redis at 80 % of a ``maxmemory`` of ``limit`` bytes (a key grown in place), read by
    the gateway's next request."""
    used = int(r.info("memory")["used_memory"])
    r.setrange("ballast", int(0.8 * limit) - used, b"x")
    r.config_set("maxmemory", limit)
    time.sleep(READ_EVERY_SECONDS)


def _store_full(answer: httpx.Response) -> dict[str, str]:
    """The error of ``answer``, a request refused for the job store's room (503)."""
    assert answer.status_code == 503, answer.text
    error: dict[str, str] = answer.json()["error"]
    assert error["type"] == "job_store_full", error
    return error


@contextmanager
def _stack(
    tmp_path: Path, model: FakeAnthropic, **settings: str
) -> Iterator[tuple[redis.Redis, httpx.Client]]:
    """Redis, a gateway and one worker on the fake model (with ``settings`` besides): the
    stack's Redis and a client of its gateway."""
    with redis_server(tmp_path / "redis") as base, redis.Redis.from_url(base + "/0") as r:
        env = stack_env(base + "/0", model.url, **settings)
        with (
            gateway(tmp_path / "g", env) as gw,
            httpx.Client(base_url=gw, timeout=90) as client,
            celery_worker(tmp_path / "w", env, "w1"),
        ):
            yield r, client


def _documents(index: str, text: str, n: int, client: httpx.Client) -> None:
    """Upsert ``n`` documents of ``text`` (ids ``d0``...) into the caller's ``index``, to the
    end of the job: its worker records the index's size before the job reads as done."""
    docs = [{"id": f"d{i}", "text": text} for i in range(n)]
    done = client.post(
        f"/v1/indexes/{index}/documents",
        params={"wait": 30},
        json={"documents": docs},
        headers=ACME,
    )
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text


def test_a_batch_s_hits_are_priced_by_what_its_index_s_documents_hold(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """A hit carries its document's text into the result, and admission priced every hit at
    420 bytes, the sample corpus's: a batch over documents of 99,000 characters was admitted
    as 1.7 MB and wrote 400 MB, filled Redis and locked every tenant out. A worker records
    what each index holds after each write, and a hit is priced by its index's mean
    document: Redis at 80 % of its maxmemory (2 MB to the 90 %), ten queries of 10 hits over
    documents of 50,000 characters (about 5 MB of results: 46 kB at the fixed price) are
    refused, naming the index; the same batch over short documents, in another index or in
    this one once its documents are replaced by short ones, is admitted and runs. A single
    search is priced the same way, as a batch of one: 50 hits over those documents (2.5 MB)
    are refused, where it was admitted with nothing added; 50 over short ones are taken."""
    with _stack(tmp_path, model) as (r, client):
        ingest(client)  # the sample corpus: short documents
        _documents("long", "chess kasparov opening " + "x" * 49_977, 50, client)
        limit = 20_000_000
        _fill_to_80_percent(r, limit)

        def batch(index: str) -> httpx.Response:
            queries = [{"id": f"q{i}", "query": "chess kasparov", "limit": 10} for i in range(10)]
            body = {"index": index, "rerank": False, "queries": queries}
            return client.post("/v1/batches", json=body, headers=ACME)

        refused = batch("long")
        error = _store_full(refused)
        assert "this batch of 10 queries" in error["message"], error
        assert "index 'long'" in error["message"], error

        def search(index: str) -> httpx.Response:
            body = {"index": index, "query": "chess kasparov", "limit": 50, "rerank": False}
            return client.post("/v1/searches", json=body, headers=ACME)

        alone = search("long")
        error = _store_full(alone)
        assert "this search" in error["message"], error
        assert "up to 50 hits over index 'long'" in error["message"], error
        assert search(INDEX).status_code == 202
        taken = [batch(INDEX)]
        _documents("long", "chess kasparov opening", 50, client)  # the same ids, short
        taken.append(batch("long"))
        for answer in taken:
            assert answer.status_code == 202, answer.text
        wait_for(
            lambda: all(
                batch_counts(client, a.json()["id"])["status"] == "succeeded" for a in taken
            ),
            "the two batches' end",
        )
        assert int(r.info("memory")["used_memory"]) < 0.9 * limit
        # the figure follows every write: an upsert's, a delete's, a drop's
        size = f"{INDEX_SIZE_KEY}acme:long"
        short = len("chess kasparov opening") + len("{}")  # its text and metadata
        assert r.hgetall(size) == {b"documents": b"50", b"bytes": b"%d" % (50 * short)}
        ids = {"ids": [f"d{i}" for i in range(10)]}
        path = "/v1/indexes/long/documents/delete"
        deleted = client.post(path, params={"wait": 30}, json=ids, headers=ACME)
        assert deleted.status_code == 200, deleted.text
        assert r.hgetall(size) == {b"documents": b"40", b"bytes": b"%d" % (40 * short)}
        dropped = client.delete("/v1/indexes/long", params={"wait": 30}, headers=ACME)
        assert dropped.status_code == 200, dropped.text
        assert not r.exists(size)


def test_a_traced_search_is_priced_with_its_trace_s_candidates(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """A trace lists every rerank candidate (up to ``candidate_limit``, 200) with its text, up
    to what the prompt shows the model (``SIFT_RERANK_CANDIDATE_MAX_CHARS``), where
    admission priced a trace at 4 kB whatever it listed. With the model shown whole
    documents of 50,000 characters and Redis at 80 % of its maxmemory (2 MB to the 90 %),
    one traced search of 1 hit and 50 candidates writes about 2.5 MB: it is refused as the
    same search of 50 hits is (found by review rev23b: priced 54.8 kB, stored 2.56 MB; a
    batch of 40 such items priced 2.2 MB with 10 MB of room filled Redis, its items'
    finishes refused OutOfMemoryError), and the same search untraced is taken."""
    with _stack(tmp_path, model, SIFT_RERANK_CANDIDATE_MAX_CHARS="50000") as (r, client):
        _documents("long", "chess kasparov opening " + "x" * 49_977, 50, client)
        _fill_to_80_percent(r, 20_000_000)
        body = TRACED_LONG
        traced = client.post("/v1/searches", json=body, headers=ACME)
        error = _store_full(traced)
        assert "up to 1 hits and 50 trace candidates over index 'long'" in error["message"]
        untraced = client.post("/v1/searches", json={**body, "include_trace": False}, headers=ACME)
        assert untraced.status_code == 202, untraced.text  # its 1 hit fits the room


def test_a_trace_holds_the_text_its_model_was_shown_within_its_search_s_price(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """A trace listed each candidate's document whole, 200 candidates of up to 100,000
    characters: a traced search over long documents wrote 47 times what its admission priced
    (review rev23b). A candidate's text is cut where the prompt cuts it for the model
    (``SIFT_RERANK_CANDIDATE_MAX_CHARS``, 1,200 by default), and the trace is priced with its
    candidates: a traced search of 1 hit and 50 candidates over documents of 50,000
    characters stores no more than its admission priced (kept in its record as
    ``owed_bytes``), each of its trace's candidates the head of its document."""
    with _stack(tmp_path, model) as (r, client):
        text = "chess kasparov opening " + "x" * 49_977
        _documents("long", text, 50, client)
        r.config_set("maxmemory", 1 << 30)  # admission prices each job by its index
        time.sleep(READ_EVERY_SECONDS)  # the gateway's next request reads it again
        body = TRACED_LONG
        made = client.post("/v1/searches", json=body, params={"wait": 30}, headers=ACME)
        assert made.status_code == 200, made.text
        search = made.json()
        assert search["status"] == "succeeded", search
        record = SEARCH_KEY + search["id"]
        priced = int(r.hget(record, "owed_bytes") or 0)
        stored = int(r.hstrlen(record, "result"))
        assert 0 < stored <= priced, (stored, priced)  # 123 kB for 157 kB priced
        trace = search["result"]["trace"]
        assert len(trace["candidates"]) == 50
        for candidate in trace["candidates"]:
            assert candidate["text"] == text[:1_200], candidate["text"][:40]
            assert candidate["truncated"] is True
        assert trace["candidate_max_chars"] == 1_200
        assert search["result"]["hits"][0]["text"] == text  # the hit's, whole


def _oom_refusals(r: redis.Redis) -> int:
    return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


def test_a_batch_admitted_at_the_line_s_edge_ends_under_it_with_what_redis_holds_for_it(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """Redis holds a result in more bytes than its JSON has (each in jemalloc's next size
    class up), and a batch was priced at its results' JSON: 12 queries of 12 hits over
    documents of 30,000 characters, priced at 4.37 MB, took 4.72 MB in their results hash
    and 5.1 MB of Redis in all. Admitted with Redis set so that it and the batch came to
    88.5 % of its maxmemory (by the gateway's own price), it took Redis to the limit itself,
    with the buffers its results were read into: a finish refused (OOM), the item left
    running (at 89.5 %, Redis was left at 90.6 %, past the line new jobs are refused past).
    Priced as Redis holds them, the batch ends, no write refused, and once those buffers are
    freed Redis holds less than 90 %."""
    with _stack(tmp_path, model) as (r, client):
        _documents("long", "chess kasparov opening " + "x" * 29_977, 12, client)
        size = r.hgetall(f"{INDEX_SIZE_KEY}acme:long")
        per_hit = hit_bytes((int(size[b"documents"]), int(size[b"bytes"])))
        price = results_bytes(12, 12 * 12, per_hit=per_hit)  # and its specs, some 3 kB
        limit = int((int(r.info("memory")["used_memory"]) + price) / 0.885)
        r.config_set("maxmemory", limit)
        time.sleep(READ_EVERY_SECONDS)  # the gateway's next request reads it again
        queries = [{"id": f"q{i}", "query": "chess kasparov", "limit": 12} for i in range(12)]
        body = {"index": "long", "rerank": False, "queries": queries}
        taken = client.post("/v1/batches", json=body, headers=ACME)
        assert taken.status_code == 202, taken.text

        def status() -> str:
            return str(batch_counts(client, taken.json()["id"])["status"])

        wait_for(lambda: status() == "succeeded" or _oom_refusals(r) > 0, "the batch's end")
        assert _oom_refusals(r) == 0 and status() == "succeeded", r.info("errorstats")

        def buffers_freed() -> bool:  # each result was read into one, freed by Redis's cron
            return all(int(c["qbuf"]) + int(c["qbuf-free"]) < 32_768 for c in r.client_list())

        wait_for(buffers_freed, "the connections' buffers freed")
        held = int(r.info("memory")["used_memory"])
        assert held < 0.9 * limit, (held / limit, price, limit)


def _waiting_text(i: int) -> str:
    """A document of some 50,000 characters, mostly ASCII, with runs of whitespace and
    characters outside it (accented, CJK, an ideographic space)."""
    line = f"chess kasparov opening {i}, d\u00e9fense  fran\u00e7aise \u56fd\u9645\u8c61\u68cb"
    line += "\u3000\n\n"
    return (line + "x" * 940 + "\n") * 50


def test_an_economy_item_waiting_at_the_provider_holds_its_prompt_s_text_within_its_price(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """An economy item keeps its prepared search in Redis while it waits at the provider
    (hours at most), and it kept each candidate's document whole: an item of 50 candidates
    over documents of 50,000 characters held 2.5 MB, which admission priced at nothing (the
    batch's 4 items held 10.5 MB for 203 kB priced). It keeps each candidate's text up to
    the prompt's cut now (as UTF-8: escaped, a CJK character took 6 bytes), and admission
    prices those records: what the batch holds while it
    waits, with the results it writes, is no more than its price (``owed_bytes``); the
    prompt the provider is sent, rebuilt from the records, is the standard lane's for the
    same search (built from the whole texts), byte for byte; and the hits, read again from
    the index at the finish, carry their documents whole."""
    with redis_server(tmp_path / "redis") as base, redis.Redis.from_url(base + "/0") as r:
        url = base + "/0"
        env = stack_env(url, model.url, SIFT_ECONOMY_POLL_SECONDS="0.2",
                        SIFT_ECONOMY_POLL_MAX_SECONDS="1")  # fmt: skip
        model.reset()
        try:
            with (
                gateway(tmp_path / "g", env) as gw,
                httpx.Client(base_url=gw, timeout=90, headers=ACME) as client,
                celery_worker(tmp_path / "w", env, "w1"),
            ):
                texts = {f"d{i}": _waiting_text(i) for i in range(50)}
                docs = [{"id": k, "text": t} for k, t in texts.items()]
                done = client.post(
                    "/v1/indexes/long/documents", params={"wait": 30}, json={"documents": docs}
                )
                assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
                r.config_set("maxmemory", 1 << 30)  # admission prices each job by its index
                time.sleep(READ_EVERY_SECONDS)  # the gateway's next request reads it again
                search = {"index": "long", "rerank": True, "candidate_limit": 50}
                query = {"query": "chess kasparov", "limit": 1}
                standard = client.post(
                    "/v1/searches", json={**search, **query}, params={"wait": 30}
                )
                assert standard.json()["status"] == "succeeded", standard.text
                [sent] = [q["body"] for q in model.requests()]

                model.configure(batch_processing_seconds=600)  # the items wait at the provider
                queries = [{"id": f"q{i}", **query} for i in range(4)]
                made = client.post("/v1/batches", json={**search, "lane": "economy",
                                                        "queries": queries})  # fmt: skip
                assert made.status_code == 202, made.text
                batch_id = made.json()["id"]
                prepared = ECONOMY_PREPARED_KEY + batch_id
                wait_for(lambda: len(model.batches()) == 1, "the provider batch's create")
                assert r.hlen(prepared) == 4
                held = sum(r.hstrlen(prepared, q["id"]) for q in queries)  # 4 x 2.5 MB before
                for raw in r.hvals(prepared):
                    assert "\u56fd\u9645\u8c61\u68cb".encode() in raw  # UTF-8, not escaped
                    for candidate in json.loads(raw)["candidates"]:
                        assert texts[candidate["id"]].startswith(candidate["text"])
                        assert len(candidate["text"]) < 1_300, len(candidate["text"])
                params = model.batches()[0]["params"]
                assert len(params) == 4
                for request in params:  # rebuilt from the records: the whole texts' prompt
                    assert request["system"] == sent["system"]
                    assert request["messages"] == sent["messages"]

                model.configure(batch_processing_seconds=0)
                wait_for(lambda: batch_counts(client, batch_id)["finished_at"], "the batch's end")
                assert batch_counts(client, batch_id)["counts"]["succeeded"] == 4
                results = BATCH_RESULTS_KEY + batch_id
                written = sum(r.hstrlen(results, q["id"]) for q in queries)
                priced = 4 * int(r.hget(BATCH_KEY + batch_id, "owed_item_bytes") or 0)
                assert 0 < held + written <= priced, (held, written, priced)
                page = client.get(f"/v1/batches/{batch_id}/results").json()["results"]
                for item in page:
                    [hit] = item["result"]["hits"]
                    assert hit["text"] == texts[hit["id"]]  # whole: read again at the finish
        finally:
            model.configure(batch_processing_seconds=0)


def test_an_economy_batch_is_priced_with_what_its_items_keep_while_they_wait(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """What an economy batch's items keep in Redis while they wait at the provider, their
    candidates' texts up to the prompt's cut, was priced at nothing: with Redis at 80 % of
    its maxmemory (2 MB to the 90 %), 20 queries of 1 hit and 50 candidates over documents
    of 50,000 characters (1 MB of results, and 1.5 MB kept while they wait) are refused,
    naming those candidates; the same batch in the standard lane, which keeps none of it,
    is taken."""
    with _stack(tmp_path, model) as (r, client):
        _documents("long", "chess kasparov opening " + "x" * 49_977, 50, client)
        limit = 20_000_000  # 2 MB of room: the standard batch 1.3 MB, the economy 3.2
        used = int(r.info("memory")["used_memory"])
        # in values of 64 kB, a size class of their own: one string of 15 MB is held in
        # jemalloc's next class up, some 2 MB more, and took the room the test leaves
        with r.pipeline(transaction=False) as fill:
            for i in range((int(0.8 * limit) - used) // 65_536):
                fill.set(f"ballast:{i}", b"x" * 65_000)
            fill.execute()
        r.config_set("maxmemory", limit)
        time.sleep(READ_EVERY_SECONDS)  # the gateway's next request reads it again
        queries = [{"id": f"q{i}", "query": "chess kasparov", "limit": 1} for i in range(20)]
        body = {"index": "long", "rerank": True, "candidate_limit": 50, "queries": queries}
        economy = client.post("/v1/batches", json={**body, "lane": "economy"}, headers=ACME)
        error = _store_full(economy)
        assert (
            "up to 20 hits and 1000 candidates kept while waiting at the provider over "
            "index 'long'" in error["message"]
        ), error
        standard = client.post("/v1/batches", json=body, headers=ACME)
        assert standard.status_code == 202, standard.text
