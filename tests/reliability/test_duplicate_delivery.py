"""The same Celery message delivered twice tells the truth once, on a real stack at defaults.

A broker can deliver a message twice (kombu's restore racing an ack, a client publishing
again after a lost reply). Here every task message of a search and of a batch is copied in
the broker's queue before the worker starts, so the two copies run side by side. The job
store's compare-and-set must keep one outcome per job and per item, and the job's status,
its counts, its result pages, its ``*.completed`` webhook and the worker's
``sift_jobs_completed_total`` must each say it once; and the model, which the fake counts,
must be called once per search: not by the copy that came while the other ran, nor by a
copy delivered once the job is final.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.integration.slow_receivers import slow_receiver
from tests.reliability.support import (
    ACME,
    Receiver,
    all_results,
    batch_counts,
    ingest,
    sample_queries,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.reliability.test_lost_replies import completed, increase
from tests.services import celery_worker, free_port, gateway, redis_server
from worker.constants import (
    BATCH_QUEUE,
    KOMBU_UNACKED_KEY,
    SEARCH_QUEUE,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)

pytestmark = pytest.mark.integration

TOTAL = 60  # three chunks at the default chunk size


def _duplicate(client: redis.Redis, queue: str) -> int:
    """Push a second copy of every message waiting in ``queue``; answers how many."""
    messages = client.lrange(queue, 0, -1)
    for raw in messages:
        client.lpush(queue, raw)
    return len(messages)


@pytest.mark.timeout(300)
def test_every_message_delivered_twice_still_finishes_each_job_once(
    tmp_path: Path, receiver: Receiver
) -> None:
    port = free_port()
    metrics = f"http://127.0.0.1:{port}/metrics"
    with FakeAnthropic(delay=0.2) as model, redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, SIFT_WORKER_METRICS_PORT=str(port))
        raw = redis.Redis.from_url(url + "/0")
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            with celery_worker(tmp_path / "w0", env, "w0"):
                ingest(client)  # then no worker: the messages wait, and are copied
            search_id = submit_search(client, sample_queries()[1], webhook_url=receiver.url)
            batch_id = submit_batch(client, TOTAL, webhook_url=receiver.url)
            copies = [(q, m) for q in (SEARCH_QUEUE, BATCH_QUEUE) for m in raw.lrange(q, 0, -1)]
            assert _duplicate(raw, SEARCH_QUEUE) == 1
            assert _duplicate(raw, BATCH_QUEUE) == 3
            # ``w`` is a fresh process, its counters at zero: what it serves at the end is what
            # it moved. (A reading taken once it is up raced it: it consumes the copies at once,
            # and on a busy machine had finished them all before that first reading.)
            with celery_worker(tmp_path / "w", env, "w"):
                wait_for(
                    lambda: batch_counts(client, batch_id)["finished_at"] is not None,
                    "the batch finished",
                )
                wait_for(
                    lambda: (
                        client.get(f"/v1/searches/{search_id}", headers=ACME).json()["status"]
                        == "succeeded"
                    ),
                    "the search finished",
                )
                wait_for(lambda: raw.llen(BATCH_QUEUE) == 0, "both copies taken")
                wait_for(lambda: len(receiver.deliveries) >= 2, "the webhooks")
                time.sleep(2.0)  # a second webhook, if any, lands now
                moved = increase({}, completed(metrics))
                statuses = {
                    job: [d.body["data"]["status"] for d in receiver.for_job(job)]
                    for job in (search_id, batch_id)
                }
                while_running = len(model.requests())
                # the copies once more, now that every job is final: none may call the model
                for queue, message in copies:
                    raw.lpush(queue, message)
                wait_for(
                    lambda: raw.llen(SEARCH_QUEUE) + raw.llen(BATCH_QUEUE) == 0,
                    "the late copies taken",
                )
                wait_for(lambda: not raw.hlen(KOMBU_UNACKED_KEY), "the late copies done")
                after_final = len(model.requests())
                # a copy of a final job sends its webhook again only while that webhook is
                # owed with no retry recorded (its first message may have died with its
                # worker): these were delivered, so the late copies send none (each sent
                # one more before, and a given-up webhook's copy began its schedule again).
                # Each copy published its webhook before its ack: none is left on its way.
                wait_for(
                    lambda: not raw.llen(WEBHOOK_QUEUE) and not raw.hlen(KOMBU_UNACKED_KEY),
                    "no webhook on its way",
                )
                late = {job: len(receiver.for_job(job)) for job in (search_id, batch_id)}
                search_bodies = [d.body for d in receiver.for_job(search_id)]
            batch = batch_counts(client, batch_id)
            results = all_results(client, batch_id)
        raw.close()
    counts = batch["counts"]
    assert batch["status"] == "succeeded" and counts["succeeded"] == TOTAL, batch
    assert [r["query_id"] for r in results] == [f"q{i:05d}" for i in range(TOTAL)]
    assert all(r["status"] == "succeeded" and "result" in r for r in results)
    # a copy that finds its job already final sends the webhook again (the same webhook-id),
    # but one copy makes each attempt (its claim, per job): once, nothing having failed
    assert statuses[batch_id] == ["succeeded"], statuses
    assert statuses[search_id] == ["succeeded"], statuses
    assert all(body == search_bodies[0] for body in search_bodies), search_bodies
    assert late == {job: len(statuses[job]) for job in statuses}, (late, statuses)
    assert moved == {
        ("search", "succeeded"): 1.0,
        ("batch_item", "succeeded"): float(TOTAL),
        ("batch", "succeeded"): 1.0,
    }, moved
    # one model call per search: a copy that came while the other ran left it to that run
    # (its claim, worker/queue/jobstore/runs.py), and a copy of a final job calls nothing
    assert while_running == TOTAL + 1, while_running
    assert after_final == while_running, after_final


def _waiting_webhooks(client: redis.Redis) -> list[dict[str, Any]]:
    """The events of the ``sift.webhook`` messages the broker holds unacked (running, or
    waiting out a hop's countdown)."""
    events = []
    for raw in client.hvals(KOMBU_UNACKED_KEY):
        envelope = json.loads(raw)[0]
        body: str | bytes = envelope["body"]
        if envelope["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if envelope["headers"]["task"] == WEBHOOK_TASK:
            events.append(json.loads(body)[0][0])
    return events


@pytest.mark.timeout(300)
def test_a_search_delivered_again_while_its_webhook_is_sent_delivers_it_once(
    tmp_path: Path,
) -> None:
    """A finished search's message delivered again (as kombu's restore puts back a message
    its task had not acked when the broker connection dropped: CI's Redis outage) while the
    webhook's first attempt is at the receiver. The search is final and its webhook owed with
    no retry recorded, so the delivery sends a copy, another message, which a real worker
    runs at once: it must not send the attempt again. It waits out the first's claim of the
    attempt (the job's, whatever the task id), then finds the webhook delivered, and stops.
    Before, the receiver got the one webhook twice, nothing having failed. With a 10 s
    delivery cap: a copy waits out a claim's lease, the cap and 30 s, before it stops."""
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp_path / "redis") as url,
        slow_receiver() as receiver,  # holds each POST until released, then 204
    ):
        env = stack_env(url + "/0", model.url, SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS="10")
        raw = redis.Redis.from_url(url + "/0")
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            with celery_worker(tmp_path / "w0", env, "w0"):
                ingest(client)  # then no worker: the search's message waits, and is kept
            search_id = submit_search(client, sample_queries()[1], webhook_url=receiver.url)
            (message,) = raw.lrange(SEARCH_QUEUE, 0, -1)
            with celery_worker(tmp_path / "w", env, "w"):
                wait_for(lambda: receiver.held == 1, "the first attempt at the receiver")
                raw.lpush(SEARCH_QUEUE, message)  # delivered again: the same message
                wait_for(
                    lambda: (
                        receiver.requests > 1
                        or any(e.get("attempt") == 1 for e in _waiting_webhooks(raw))
                    ),
                    "the copy sent, or waiting for the first's claim",
                )
                at_once = receiver.requests
                receiver.release.set()
                wait_for(
                    lambda: not raw.llen(WEBHOOK_QUEUE) and not _waiting_webhooks(raw),
                    "the copy done",
                )
                search = client.get(f"/v1/searches/{search_id}", headers=ACME).json()
        raw.close()
    assert at_once == 1 and receiver.requests == 1, (at_once, receiver.requests)
    assert search["status"] == "succeeded"
    assert search["webhook"] == {"status": "delivered", "attempts": 1}, search["webhook"]
