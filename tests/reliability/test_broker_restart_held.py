"""Redis restarted while a live worker holds a webhook's retry (a countdown): the retry runs
when due, not once the broker's visibility timeout puts its message back.

A countdown waits in the worker's memory while its message sits in kombu's ``unacked`` hash.
When the broker connection drops, Celery drops every request it held that had not gone to the
pool (their delivery tags belonged to the lost channel), and kombu's restore at the channel's
close fails while Redis is down. The message outlives the restart (AOF on, as ``sift up`` and
``deploy/`` run Redis) but nothing ran it: the worker is alive, so the dead-worker check left
it, and it came back only after the visibility timeout (about 27 minutes at the defaults; the
audit saw 650 retries run 22 to 24 minutes late). Now the worker puts back what it dropped as
its consumer starts again (:meth:`worker.queue.liveness.Liveness.reconnected`).

Two cases, each with one redis-server (AOF ``everysec``), one gateway and one ``sift worker``
at default settings.

A webhook's retry, at the default visibility timeout. The
receiver answers 500 once, then 204; the first retry is due 8 to 12 s later
(``SIFT_WEBHOOK_RETRY_SCALE`` 2). Once the worker holds it, redis-server is SIGKILLed and
started again on its AOF. The second POST must come well before the visibility timeout could
have restored the message (within a tenth of it), and be the last: nothing is left unacked to
come back later.

An economy batch's poll (audit repro A). The fake provider batch ends 5 s after it is made;
the worker holds the first poll for its 30 s countdown when redis-server is SIGKILLed and
started again. The batch must end before the economy watch could have sent the poll again
(its 300 s margin), without it: the poll that ran is the one the worker held. Before the fix
the batch ended only after the watch's rescue (328-352 s in the audit's runs).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.economy import finished, submit_economy
from tests.reliability.support import (
    DOWN_SECONDS,
    FlakyReceiver,
    assert_batch_exactly_once,
    broker,
    ingest,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, gateway
from worker.constants import (
    DELIVERY_OWNERS_KEY,
    ECONOMY_POLL_TASK,
    KOMBU_UNACKED_KEY,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.queue.config import visibility_timeout
from worker.queue.economy.leases import WATCH_MARGIN_SECONDS
from worker.settings import load_settings

pytestmark = pytest.mark.integration

SCALE = 2.0  # the first retry's wait: 5 s x 2, with the schedule's jitter 8 to 12 s


def held_retries(client: redis.Redis, task: str = WEBHOOK_TASK) -> list[str]:
    """The delivery tags of ``task``'s messages unacked with an ETA that a worker recorded
    as held: waiting out its countdown in the worker."""
    owners = client.hgetall(DELIVERY_OWNERS_KEY)
    held = []
    for tag, raw in client.hgetall(KOMBU_UNACKED_KEY).items():
        headers = json.loads(raw)[0]["headers"]
        if headers.get("task") == task and headers.get("eta") and tag in owners:
            held.append(tag)
    return held


def waiting_in_brpop(client: redis.Redis) -> bool:
    """A consumer blocked in ``BRPOP``: the kill then breaks a reply it waits for."""
    return any(c["cmd"] == "brpop" and "b" in c["flags"] for c in client.client_list())


def webhook_messages(client: redis.Redis) -> int:
    """Webhook messages still queued or unacked: any would run (again) later."""
    unacked = [json.loads(raw)[0]["headers"].get("task") for raw in client.hvals(KOMBU_UNACKED_KEY)]
    return int(client.llen(WEBHOOK_QUEUE)) + unacked.count(WEBHOOK_TASK)


@pytest.mark.timeout(600)
def test_a_retry_a_live_worker_held_through_a_redis_restart_runs_when_due(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    receiver = FlakyReceiver(failures=1)  # 500 to the first POST, then 204
    with receiver.serve(), broker(tmp_path / "redis") as redis_broker:
        url = redis_broker.url + "/0"
        env = stack_env(url, model.url, SIFT_WEBHOOK_RETRY_SCALE=str(SCALE))
        # the visibility timeout these defaults derive: the restore the fix must come before
        visibility = visibility_timeout(load_settings(redis_url=url))
        prompt = visibility / 10
        with (
            celery_worker(tmp_path / "w", env, "w"),  # default visibility timeout
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            submit_search(client, sample_queries()[0], webhook_url=receiver.url)
            probe = redis.Redis.from_url(url, decode_responses=True)
            wait_for(lambda: receiver.posts() == 1, "the first attempt (answered 500)")
            wait_for(lambda: bool(held_retries(probe)), "the worker holding the retry")
            wait_for(lambda: waiting_in_brpop(probe), "the consumer waiting in BRPOP")
            # the first attempt's message acked (the retry's is all that is left): killed
            # before that ack reached the AOF, it stayed unacked for kombu to restore at the
            # visibility timeout (its run then finds the webhook delivered), and the check
            # below that nothing is left failed in one run of 2,735 (4 December)
            wait_for(lambda: webhook_messages(probe) == 1, "only the retry's message left")
            tags = held_retries(probe)
            redis_broker.written(probe)  # the held message is in the AOF, not just in memory
            # read off the disk: once Redis is back, the worker may put it back in its queue
            # (out of unacked) before a look there, the faster the busier the host
            assert tags and redis_broker.on_disk(tags)
            probe.close()
            redis_broker.kill(signal.SIGKILL)
            killed = time.monotonic()
            assert receiver.posts() == 1  # the retry was still waiting when Redis went
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            probe = redis.Redis.from_url(url, decode_responses=True)
            wait_for(lambda: receiver.posts() >= 2, "the retry after the restart", prompt)
            ran_after = time.monotonic() - killed
            # it was the last: nothing of it left queued or unacked to run again later
            wait_for(lambda: webhook_messages(probe) == 0, "no webhook message left", 30)
            probe.close()
    assert receiver.posts() == 2
    print(f"\nthe retry ran {ran_after:.1f} s after the kill (visibility timeout {visibility} s)")


@pytest.mark.timeout(900)
def test_an_economy_poll_a_live_worker_held_through_a_redis_restart_runs_when_due(
    tmp_path: Path,
) -> None:
    with FakeAnthropic() as model, broker(tmp_path / "redis") as redis_broker:
        model.configure(batch_processing_seconds=5.0)
        url = redis_broker.url + "/0"
        env = stack_env(url, model.url)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # every setting at its default
        with (
            celery_worker(tmp_path / "w", env, "w"),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            batch_id = submit_economy(client, 5)
            probe = redis.Redis.from_url(url, decode_responses=True)
            wait_for(lambda: len(model.batches()) == 1, "the provider batch made", 120)

            def polls() -> list[str]:
                return held_retries(probe, ECONOMY_POLL_TASK)

            wait_for(lambda: bool(polls()), "the worker holding its poll", 60)
            wait_for(lambda: waiting_in_brpop(probe), "the consumer waiting in BRPOP")
            tags = polls()
            redis_broker.written(probe)  # the held message is in the AOF, not just in memory
            # read off the disk: once Redis is back, the worker may put it back in its queue
            # (out of unacked) before a look there, the faster the busier the host
            assert tags and redis_broker.on_disk(tags)
            probe.close()
            redis_broker.kill(signal.SIGKILL)
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            # before the watch's margin has passed, the watch cannot have sent it again
            wait_for(lambda: finished(client, batch_id), "the batch ended", WATCH_MARGIN_SECONDS)
            assert_batch_exactly_once(client, url, batch_id, 5)
        log = (tmp_path / "w" / "w.log").read_text(errors="replace")
        assert "did not run when due; sent again" not in log  # the held poll ran, not a rescue
        assert len(model.batches()) == 1
