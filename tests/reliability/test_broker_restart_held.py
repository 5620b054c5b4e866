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

One redis-server, one gateway and one ``sift worker``, at the default visibility timeout. The
receiver answers 500 once, then 204; the first retry is due 8 to 12 s later
(``SIFT_WEBHOOK_RETRY_SCALE`` 2). Once the worker holds it, redis-server is SIGKILLed and
started again on its AOF. The second POST must come well before the visibility timeout could
have restored the message (within a tenth of it), and be the last: nothing is left unacked to
come back later.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    DOWN_SECONDS,
    broker,
    ingest,
    sample_queries,
    serve_hook,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, gateway
from worker.constants import DELIVERY_OWNERS_KEY, KOMBU_UNACKED_KEY, WEBHOOK_QUEUE, WEBHOOK_TASK
from worker.queue.config import visibility_timeout
from worker.settings import load_settings

pytestmark = pytest.mark.integration

SCALE = 2.0  # the first retry's wait: 5 s x 2, with the schedule's jitter 8 to 12 s


class OnceFailing:
    """Answers 500 to the first POST, 204 to the others; counts them."""

    def __init__(self) -> None:
        self.posts = 0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                with receiver.lock:
                    receiver.posts += 1
                    first = receiver.posts == 1
                self.send_response(500 if first else 204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        with serve_hook(Handler) as url:
            yield url

    def count(self) -> int:
        with self.lock:
            return self.posts


def held_retries(client: redis.Redis) -> list[str]:
    """The delivery tags of the webhook messages unacked with an ETA that a worker recorded
    as held: the retry waiting out its countdown in the worker."""
    owners = client.hgetall(DELIVERY_OWNERS_KEY)
    held = []
    for tag, raw in client.hgetall(KOMBU_UNACKED_KEY).items():
        headers = json.loads(raw)[0]["headers"]
        if headers.get("task") == WEBHOOK_TASK and headers.get("eta") and tag in owners:
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
    receiver = OnceFailing()
    with receiver.serve() as hook_url, broker(tmp_path / "redis") as redis_broker:
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
            submit_search(client, sample_queries()[0], webhook_url=hook_url)
            probe = redis.Redis.from_url(url, decode_responses=True)
            wait_for(lambda: receiver.count() == 1, "the first attempt (answered 500)")
            wait_for(lambda: bool(held_retries(probe)), "the worker holding the retry")
            wait_for(lambda: waiting_in_brpop(probe), "the consumer waiting in BRPOP")
            tags = held_retries(probe)
            probe.close()
            redis_broker.kill(signal.SIGKILL)
            killed = time.monotonic()
            assert receiver.count() == 1  # the retry was still waiting when Redis went
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            probe = redis.Redis.from_url(url, decode_responses=True)
            assert set(tags) <= set(probe.hkeys(KOMBU_UNACKED_KEY))  # the AOF kept it
            wait_for(lambda: receiver.count() >= 2, "the retry after the restart", prompt)
            ran_after = time.monotonic() - killed
            # it was the last: nothing of it left queued or unacked to run again later
            wait_for(lambda: webhook_messages(probe) == 0, "no webhook message left", 30)
            probe.close()
    assert receiver.count() == 2
    print(f"\nthe retry ran {ran_after:.1f} s after the kill (visibility timeout {visibility} s)")
