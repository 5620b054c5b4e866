"""Index reads no worker answers leave ``/readyz`` and other tenants' searches answering.

A real gateway under uvicorn on a real Redis, and no worker: each index read waits its
``INDEX_READ_TIMEOUT_SECONDS`` (10 s) for an answer that never comes, then ``503``. Its wait
held one of the threadpool's 40 threads, which ``/readyz`` and every blocking store call
(``GET /v1/searches/{id}`` among them) share: 60 such reads from one tenant made the probe
wait 10 s and more (past the k8s probe's 3 s, three times: both replicas out of the Service,
a worker outage became an API outage), and another tenant's search poll with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from tests.keys import ACME, ACME_KEY, GLOBEX, GLOBEX_KEY
from tests.reliability.support import INDEX, Stack, stack_env, wait_for
from tests.services import gateway, redis_server
from worker.constants import INDEX_READ_TIMEOUT_SECONDS, SEARCH_QUEUE

pytestmark = pytest.mark.integration

THREADPOOL_TOKENS = 40  # anyio's default: run_in_threadpool's threads at once
READS = 60  # more than the threadpool holds


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Redis and a gateway serving acme and globex; no worker, and no model (none is asked)."""
    with redis_server(tmp_path / "redis") as base_url:
        url = base_url + "/0"
        keys = json.dumps([ACME_KEY, GLOBEX_KEY])
        env = stack_env(url, "http://127.0.0.1:9", SIFT_API_KEYS=keys)
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            yield Stack(url, client, env)


def test_unanswered_index_reads_take_no_thread_from_readyz_or_a_search_poll(
    stack: Stack,
) -> None:
    sent = stack.client.post(
        "/v1/searches",
        json={"index": INDEX, "query": "green tea", "mode": "fts", "rerank": False},
        headers=GLOBEX,
    )
    assert sent.status_code == 202, sent.text
    search_id = sent.json()["id"]
    limits = httpx.Limits(max_connections=READS + 10, max_keepalive_connections=READS + 10)
    with (
        redis.Redis.from_url(stack.redis_url) as broker,
        httpx.Client(base_url=str(stack.client.base_url), timeout=60, limits=limits) as reads,
        ThreadPoolExecutor(READS) as pool,
    ):
        queued = int(broker.llen(SEARCH_QUEUE))  # the search's message
        pending = [
            pool.submit(reads.get, f"/v1/indexes/{INDEX}", headers=ACME) for _ in range(READS)
        ]
        # every thread taken, were the reads on them: each read's task message is sent
        # before its wait, and no worker takes one
        wait_for(
            lambda: int(broker.llen(SEARCH_QUEUE)) - queued >= THREADPOOL_TOKENS,
            "the index reads sent to the search queue",
            INDEX_READ_TIMEOUT_SECONDS / 2,
        )
        ready = stack.client.get("/readyz")
        search = stack.client.get(f"/v1/searches/{search_id}", headers=GLOBEX)
        # answered while every index read still waited for its worker
        still_waiting = sum(not read.done() for read in pending)
        assert ready.status_code == 200, ready.text
        assert search.status_code == 200, search.text
        assert search.json()["status"] == "queued", search.json()
        assert still_waiting == READS
        answers = [read.result() for read in pending]
    said = f"no worker answered the index read within {INDEX_READ_TIMEOUT_SECONDS:g} s; retry"
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json() == {"error": {"type": "backend_unavailable", "message": said}}
