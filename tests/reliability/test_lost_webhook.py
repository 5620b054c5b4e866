"""A webhook whose task message the broker lost is still delivered, once.

kombu's Redis transport takes a message with ``BRPOP`` and records it in ``unacked`` only in a
second command: a worker killed between the two (or a Redis killed after the pop reached its
AOF) loses the message. The re-drive sent lost searches, ingests and batch chunks again, but
not webhooks: a finished job whose ``sift.webhook`` message was lost was never announced.

Now the job's final move records its webhook owed (in the same script), the delivery task
settles it, and the re-drive sends again a webhook still owed a grace period (the broker's
visibility timeout) past its due time. The test runs everything real (redis-server, the
gateway, ``sift worker`` processes, the fake model, an HTTP receiver) at the defaults: a
worker that consumes no webhooks finishes a search and a batch, both with a webhook; their
two webhook messages are taken off the queue, as by workers killed between the pop and the
record; a worker consuming every queue is then started. A sweep at the real clock sends
nothing (the webhooks are due, not overdue: a live delivery is not doubled); one whose clock
is past the grace sends both again (the workers' own sweepers would, 27 minutes later), and
each arrives once, signed, with the job's ``webhook-id``, and is then owed no more.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import httpx
import pytest
import redis
from standardwebhooks.webhooks import Webhook

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    KEYS,
    ingest,
    sample_queries,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.services import (
    Received,
    celery_worker,
    gateway,
    redis_server,
    webhook_figures,
    webhook_inbox,
)
from worker.constants import RESULT_TTL_SECONDS, WEBHOOK_QUEUE, WEBHOOKS_OWED_KEY, kombu_queue_keys
from worker.queue.celery_app import create_celery_app
from worker.queue.config import visibility_timeout
from worker.queue.jobstore import JobStore
from worker.queue.redrive import Sweeper, celery_sender
from worker.settings import load_settings

pytestmark = pytest.mark.integration

NO_WEBHOOKS = "sift.search,sift.batch,sift.ingest"


def webhook_messages(client: redis.Redis) -> int:
    return sum(int(client.llen(key)) for key in kombu_queue_keys(WEBHOOK_QUEUE))


def lose_webhook_messages(client: redis.Redis) -> None:
    """Drop every waiting webhook message: workers that popped them and died."""
    client.delete(*kombu_queue_keys(WEBHOOK_QUEUE))


def drain(inbox: queue.Queue[Received]) -> list[Received]:
    out: list[Received] = []
    while True:
        try:
            out.append(inbox.get_nowait())
        except queue.Empty:
            return out


@pytest.mark.timeout(240)
def test_a_lost_webhook_message_is_sent_again_and_arrives_once(tmp_path: Path) -> None:
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp_path / "redis") as url,
        webhook_inbox() as (hook, inbox),
    ):
        # the defaults, the webhook schedule's included (stack_env shortens it)
        env = stack_env(url + "/0", model.url, SIFT_WEBHOOK_RETRY_SCALE="1")
        settings = load_settings(redis_url=url + "/0")
        grace = visibility_timeout(settings)
        store = JobStore.from_url(url + "/0")
        app = create_celery_app(settings)
        sweeper = Sweeper(
            store,
            celery_sender(app),
            interval_seconds=settings.redrive_interval_seconds,
            stall_seconds=settings.redrive_stall_seconds,
            webhook_grace_seconds=grace,
        )
        try:
            with (
                gateway(tmp_path / "g", env) as base,
                httpx.Client(base_url=base, timeout=30) as client,
            ):
                with celery_worker(tmp_path / "w1", env, "w1", queues=NO_WEBHOOKS):
                    ingest(client)
                    search_id = submit_search(client, sample_queries()[0], webhook_url=hook)
                    batch_id = submit_batch(client, 2, webhook_url=hook)
                    wait_for(lambda: webhook_messages(store.redis) == 2, "both webhooks published")
                # the final moves recorded both webhooks owed
                owed = dict(store.redis.zrange(WEBHOOKS_OWED_KEY, 0, -1, withscores=True))
                assert set(owed) == {search_id, batch_id}
                lose_webhook_messages(store.redis)
                with celery_worker(tmp_path / "w2", env, "w2"):
                    assert sweeper.resend_webhooks() == []  # due, not overdue
                    resent = sweeper.resend_webhooks(now=time.time() + grace + 1)
                    assert sorted(resent) == sorted([search_id, batch_id])
                    wait_for(lambda: inbox.qsize() >= 2, "both webhooks delivered", 60)
                    wait_for(lambda: store.redis.zcard(WEBHOOKS_OWED_KEY) == 0, "settled")
                    # owed no more: a later sweep sends nothing, and nothing else arrives
                    assert sweeper.resend_webhooks(now=time.time() + 10 * grace) == []
                    time.sleep(3)
                    statuses = {
                        search_id: client.get(f"/v1/searches/{search_id}", headers=ACME),
                        batch_id: client.get(f"/v1/batches/{batch_id}", headers=ACME),
                    }
        finally:
            store.close()
            app.close()
    received = drain(inbox)
    ids = sorted(headers["webhook-id"] for _, headers in received)
    assert ids == sorted([f"msg_{search_id}", f"msg_{batch_id}"])  # each exactly once
    secret = KEYS[0]["webhook_secret"]
    for body, headers in received:
        event = Webhook(secret).verify(body, headers)
        job_id = event["data"]["id"]
        assert headers["webhook-id"] == f"msg_{job_id}"
        assert event["type"] == ("search.completed" if job_id == search_id else "batch.completed")
        assert event["data"]["status"] == statuses[job_id].json()["status"] == "succeeded"
        # sent again by the sweep, still the job's final figures: those its GET answers
        assert event["data"] == webhook_figures(statuses[job_id].json())
        assert json.loads(body) == event


@pytest.mark.timeout(240)
def test_with_the_redrive_off_the_owed_set_keeps_nothing_past_the_retention(
    tmp_path: Path,
) -> None:
    """With ``SIFT_REDRIVE_INTERVAL_SECONDS=0`` no sweep reads ``sift:webhooks-owed``: an entry
    whose message was lost stayed for good (the set had no TTL), and the set grew with every
    one. A delivery now drops each due before the retention window (its record has expired:
    there is nothing to send again); one lost within it stays owed, for a re-drive turned on."""
    with (
        FakeAnthropic() as model,
        redis_server(tmp_path / "redis") as url,
        webhook_inbox() as (hook, inbox),
    ):
        env = stack_env(url + "/0", model.url, SIFT_REDRIVE_INTERVAL_SECONDS="0")
        store = JobStore.from_url(url + "/0")
        try:
            now = time.time()
            lost = {"srch_lost_long_ago": now - RESULT_TTL_SECONDS - 60, "srch_lost": now - 60}
            store.redis.zadd(WEBHOOKS_OWED_KEY, lost)
            with (
                gateway(tmp_path / "g", env) as base,
                httpx.Client(base_url=base, timeout=30) as client,
                celery_worker(tmp_path / "w", env, "w"),
            ):
                ingest(client)
                search_id = submit_search(client, sample_queries()[0], webhook_url=hook)
                wait_for(lambda: inbox.qsize() >= 1, "the webhook delivered", 60)

                def settled() -> bool:
                    return store.redis.zscore(WEBHOOKS_OWED_KEY, search_id) is None

                wait_for(settled, "the delivered webhook settled")
                assert store.redis.zrange(WEBHOOKS_OWED_KEY, 0, -1) == ["srch_lost"]
        finally:
            store.close()
