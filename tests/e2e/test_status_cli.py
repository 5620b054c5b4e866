"""``sift status`` against the real stack: a running batch's queue depth, the worker that holds
its chunks (by its heartbeat and by Celery's own inspection) and the batch itself.

The e2e worker runs 16 Celery threads (``--without-gossip --without-mingle``, remote control
on) and takes one chunk per thread; a batch of 20 chunks whose reranks wait 10 s on the fake
model keeps 4 chunks in ``sift.batch`` and 16 unacked for those 10 s, whatever the machine's
load, while ``sift status`` runs as its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis

from tests.e2e.conftest import ACME, INDEX, Stack
from tests.fake_anthropic import positions
from worker.clock import server_seconds
from worker.constants import (
    ALL_QUEUES,
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    DELIVERY_OWNERS_KEY,
    KOMBU_UNACKED_KEY,
    WORKER_HEARTBEAT_KEY,
)

CHUNK = 25  # the default SIFT_BATCH_CHUNK_SIZE
THREADS = 16  # the e2e worker's concurrency
MODEL_SECONDS = 10.0  # what a canceled batch's held reranks may take to end


def _status(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SIFT_REDIS_URL": stack.redis_url + "/0", "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _chunks_held(client: redis.Redis) -> tuple[int, int]:
    """The batch queue's deliveries taken (kombu's unacked, by routing key), and how many of
    them the worker's heartbeat has recorded. Not every delivery: an earlier test's task
    scheduled for later (an erase's ``sift.rewrite_owed``, due when Redis's rewrite latch
    expires, up to 5 minutes; a delete's retry) is held unacked by the same worker until
    it is due."""
    taken = {
        tag
        for tag, raw in cast(dict[str, str], client.hgetall(KOMBU_UNACKED_KEY)).items()
        if json.loads(raw)[2] == BATCH_QUEUE
    }
    return len(taken), len(taken & set(cast(list[str], client.hkeys(DELIVERY_OWNERS_KEY))))


@pytest.fixture
def running_batch(stack: Stack, corpus: object) -> Iterator[str]:
    """A reranked batch of 20 chunks, each rerank held at the model until the test is done
    looking (answered after 10 s, a run of sift status on a loaded CI machine, load 10, came
    after an item finished); canceled at the end, and waited for, so the next test finds the
    worker idle."""
    stack.model.configure(hold_unscripted=True)
    queries = [{"id": f"s{i}", "query": "green tea"} for i in range((THREADS + 4) * CHUNK)]
    body = {"index": INDEX, "queries": queries, "rerank": True}
    batch_id = str(stack.live.post("/v1/batches", json=body, headers=ACME).json()["id"])
    try:
        client = redis.Redis.from_url(stack.redis_url + "/0", decode_responses=True)
        deadline = time.monotonic() + 30
        # settled: every thread holds a chunk (and the heartbeat thread has recorded it)
        while (client.llen(BATCH_QUEUE), *_chunks_held(client)) != (4, THREADS, THREADS):
            assert time.monotonic() < deadline, "the worker did not take its chunks"
            time.sleep(0.05)
        client.close()
        yield batch_id
    finally:
        stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME)
        stack.model.configure(hold_unscripted=False)
        deadline = time.monotonic() + 3 * MODEL_SECONDS
        while not stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()["finished_at"]:
            assert time.monotonic() < deadline, "the canceled batch did not finish"
            time.sleep(0.2)


def test_sift_status_shows_the_queue_the_worker_and_the_batch(
    stack: Stack, running_batch: str
) -> None:
    client = redis.Redis.from_url(stack.redis_url + "/0", decode_responses=True)
    [beat_key] = list(client.scan_iter(WORKER_HEARTBEAT_KEY + "*"))
    # on Redis's clock, the one the heartbeat is written on and the command reads ages on
    beat_before, read_from = float(client.get(beat_key) or 0), server_seconds(client.time())
    run = _status(stack, "--json")
    read_by, beat_after = server_seconds(client.time()), float(client.get(beat_key) or 0)
    client.close()
    assert run.returncode == 0, run.stderr
    # what follows is a snapshot of the running batch only if none of its items had finished
    # when the status was taken (an order of events: its reranks are answered after 10 s; a
    # chunk holds its message until its every item is final)
    batch_now = stack.live.get(f"/v1/batches/{running_batch}", headers=ACME).json()
    assert batch_now["counts"]["succeeded"] == 0, "the status came after an item finished"
    status: dict[str, Any] = json.loads(run.stdout)

    queues = {q["name"]: q for q in status["queues"]}
    assert set(queues) == set(ALL_QUEUES)
    assert (queues[BATCH_QUEUE]["ready"], queues[BATCH_QUEUE]["unacked"]) == (4, THREADS)
    assert queues[BATCH_QUEUE]["by_priority"]["0"] == 4

    [worker] = status["workers"]
    assert worker["node"].startswith("w1@") and beat_key.endswith(worker["worker_id"])
    # the age of the heartbeat it read (one of those seen around the run) when it ran
    age = worker["beat_age_seconds"]
    assert read_from - beat_after - 0.05 <= age <= read_by - beat_before + 0.05, age
    assert status["inspect_answered"] and status["unknown_nodes"] == []
    # Redis's view, then Celery's: the chunks (the worker may also hold a task an earlier
    # test scheduled for later, which Celery lists as scheduled, not active: _chunks_held)
    holds, active = ([d for d in seen if d["task"] == BATCH_CHUNK_TASK]
                     for seen in (worker["holds"], worker["active"]))  # fmt: skip
    assert active == worker["active"]
    for seen in (holds, active):
        assert len(seen) == THREADS
        assert all(running_batch in d["args"] for d in seen)
    assert {d["task_id"] for d in holds} == {d["task_id"] for d in active}

    [batch] = [b for b in status["batches"] if b["id"] == running_batch]
    assert (batch["tenant"], batch["index"], batch["total"]) == ("acme", INDEX, 20 * CHUNK)
    assert batch["counts"]["running"] > 0 and batch["counts"]["succeeded"] == 0

    table = _status(stack)  # the same, as tables
    assert table.returncode == 0, table.stderr
    for text in ("Queues", BATCH_QUEUE, "Workers alive: 1", worker["node"], "for jobs"):
        assert text in table.stdout
    assert table.stdout.count(running_batch) == 2  # the worker's job, and the batch running


def test_sift_status_shows_what_a_running_batchs_finished_items_cost(
    stack: Stack, corpus: object
) -> None:
    # three reranks answered at once, every other held until the test is done looking (a
    # delay of 10 s had let the batch finish between two runs of sift status on a loaded
    # machine): while the batch runs, its row shows the three finished items' cost, the sum
    # of their results' usage
    stack.model.configure(hold_unscripted=True)
    stack.model.script([positions([1])] * 3)
    queries = [{"id": f"c{i}", "query": "green tea"} for i in range(6)]
    body = {"index": INDEX, "queries": queries, "rerank": True}
    batch_id = str(stack.live.post("/v1/batches", json=body, headers=ACME).json()["id"])
    try:
        deadline = time.monotonic() + 30
        while True:
            batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
            if batch["counts"]["succeeded"] == 3:
                break
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
        page = stack.live.get(f"/v1/batches/{batch_id}/results", headers=ACME).json()
        cost = sum(r["result"]["usage"]["cost_usd"] for r in page["results"] if r.get("result"))
        assert cost > 0
        run = _status(stack, "--json", "--no-inspect")
        assert run.returncode == 0, run.stderr
        [row] = [b for b in json.loads(run.stdout)["batches"] if b["id"] == batch_id]
        assert row["counts"]["succeeded"] == 3
        assert row["cost_usd"] == pytest.approx(cost, rel=1e-9)
        table = _status(stack, "--no-inspect")
        assert f"${cost:.6f}" in table.stdout, table.stdout
    finally:
        stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME)
        stack.model.configure(hold_unscripted=False)
        deadline = time.monotonic() + 3 * MODEL_SECONDS
        while not stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()["finished_at"]:
            assert time.monotonic() < deadline, "the canceled batch did not finish"
            time.sleep(0.2)


def test_sift_status_without_redis_is_one_clear_error(stack: Stack) -> None:
    env = {**os.environ, "SIFT_REDIS_URL": "redis://127.0.0.1:1/0"}
    run = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--no-inspect"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1 and "SIFT_REDIS_URL" in run.stderr
    assert "Traceback" not in run.stderr
