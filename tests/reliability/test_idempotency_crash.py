"""An Idempotency-Key survives a gateway crash: one job per key, whatever was killed when.

A real redis-server and the gateway under uvicorn (``sift gateway``), no worker: the 40
searches sent with ``?wait=20`` are all still waiting when the gateway is SIGKILLed, and the
20 batches (2,000 queries each) are caught at every stage (not yet read, being parsed,
being written, answered). A new gateway then gets every key again with the same body:

* right away, a key whose job was written before the crash answers with that job (200/202,
  as a replay), and a key only claimed answers 409 (or, once free, creates its job);
* after the pending window (the markers that name no job are expired here, as 120 s
  would), every key answers 202 with a job, and Redis holds exactly one job per key: the
  one the key was bound to before the crash wherever there was one.
"""

from __future__ import annotations

import contextlib
import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from tests.reliability.support import ACME, INDEX, sample_queries, stack_env, wait_for
from tests.services import killable_gateway, redis_server
from worker.constants import (
    BATCH_KEY,
    IDEMPOTENCY_KEY,
    IDEMPOTENCY_PENDING_TTL_SECONDS,
    IDEMPOTENCY_TTL_SECONDS,
    SEARCH_KEY,
)
from worker.queue.jobstore.idempotency import _idem_key

SEARCHES, BATCHES, BATCH_SIZE = 40, 20, 2_000


def requests() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(key, path, params, body) of every keyed submission."""
    queries = sample_queries()
    sent: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
        (
            f"search-{i}",
            "/v1/searches",
            {"wait": 20},
            {"index": INDEX, "query": queries[i % len(queries)]},
        )
        for i in range(SEARCHES)
    ]
    for b in range(BATCHES):
        items = [
            {"id": f"q{i}", "query": f"{queries[i % len(queries)]} {b}"} for i in range(BATCH_SIZE)
        ]
        sent.append((f"batch-{b}", "/v1/batches", {}, {"index": INDEX, "queries": items}))
    return sent


def post(
    url: str, key: str, path: str, params: dict[str, Any], body: dict[str, Any]
) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as client:
        return client.post(path, params=params, json=body, headers={**ACME, "Idempotency-Key": key})


def resend(
    url: str, sent: list[tuple[str, str, dict[str, Any], dict[str, Any]]], wait: float = 0
) -> dict[str, httpx.Response]:
    """Every key again with its body, all at once (a search with ``?wait=wait``)."""
    with ThreadPoolExecutor(len(sent)) as pool:
        futures = {
            key: pool.submit(post, url, key, path, {"wait": wait} if params else {}, body)
            for key, path, params, body in sent
        }
        return {key: future.result() for key, future in futures.items()}


def jobs(store: redis.Redis) -> int:
    return len(store.keys(SEARCH_KEY + "*")) + len(store.keys(BATCH_KEY + "*"))


def bindings(store: redis.Redis, keys: list[str]) -> dict[str, str | None]:
    """Each key's job as Redis holds it now (None: claimed with no job, or never seen)."""
    found: dict[str, str | None] = {}
    for key in keys:
        raw = store.get(_idem_key("acme", key))
        found[key] = json.loads(raw)["job"] if raw else None
    return found


def test_a_gateway_killed_during_keyed_submissions_never_gives_a_key_a_second_job(
    tmp_path: Path,
) -> None:
    sent = requests()
    keys = [key for key, *_ in sent]
    with redis_server(tmp_path / "redis") as redis_base:
        redis_url = redis_base + "/0"
        env = stack_env(redis_url, "http://127.0.0.1:9")
        store = redis.Redis.from_url(redis_url, decode_responses=True)
        with (
            killable_gateway(tmp_path, env, "g1") as (proc, url),
            ThreadPoolExecutor(len(sent)) as pool,
        ):
            futures = [pool.submit(post, url, *request) for request in sent]
            # kill it once some of each kind exist: the rest is caught on its way
            wait_for(
                lambda: (
                    len(store.keys(SEARCH_KEY + "*")) >= SEARCHES // 2
                    and len(store.keys(BATCH_KEY + "*")) >= 3
                ),
                "some searches and batches created",
                timeout=60,
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            answered = {}
            for (key, *_), future in zip(sent, futures, strict=True):
                with contextlib.suppress(httpx.HTTPError):
                    response = future.result()
                    answered[key] = response
        before = bindings(store, keys)
        created = {key: job for key, job in before.items() if job is not None}
        jobs_before = jobs(store)
        assert jobs_before == len(created), "a job without its key's binding, or the reverse"
        assert 0 < len(created) < len(keys), "the kill should catch keys on both sides"
        for key, response in answered.items():  # an answer given before the kill names it
            assert response.json()["id"] == created[key]
        for key in created:  # bound for the key's 24 h, not the pending window
            ttl = store.ttl(_idem_key("acme", key))
            assert IDEMPOTENCY_PENDING_TTL_SECONDS < ttl <= IDEMPOTENCY_TTL_SECONDS

        with killable_gateway(tmp_path, env, "g2") as (_, url):
            right_after = resend(url, sent, wait=1)  # a search's replay waits like the original
            for key, response in right_after.items():
                assert response.status_code in (200, 202, 409), (key, response.text)
                if key in created:  # a replay, not a 409 until the marker expires
                    assert response.status_code in (200, 202), (key, response.text)
                    assert response.json()["id"] == created[key]

            conflicts = sum(r.status_code == 409 for r in right_after.values())
            print(
                f"killed with {len(created)} of {len(keys)} keys bound to a job"
                f" ({sum(k.startswith('batch') for k in created)} batches),"
                f" {len(answered)} answered; right after the restart {conflicts} got 409"
            )
            # the pending window passes: markers naming no job expire (as after 120 s)
            markers = [
                k
                for k in store.keys(IDEMPOTENCY_KEY + "*")
                if json.loads(store.get(k))["job"] is None
            ]
            for marker in markers:
                assert 0 < store.ttl(marker) <= IDEMPOTENCY_PENDING_TTL_SECONDS
                store.delete(marker)

            final = resend(url, sent)
            again = resend(url, sent)
        ids = {key: response.json()["id"] for key, response in final.items()}
        assert all(r.status_code == 202 for r in final.values()), [r.text for r in final.values()]
        assert {key: ids[key] for key in created} == created  # the job from before the crash
        assert {key: r.json()["id"] for key, r in again.items()} == ids
        assert len(set(ids.values())) == len(keys)
        assert jobs(store) == len(keys)  # exactly one job per key: zero second jobs
        store.close()
