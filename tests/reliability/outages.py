"""What the tests of Redis down past the worker's retries share (``test_redis_outage_*``):
a stack at the defaults, no setting shortened, whose fake model holds every call until
lowered, and the kill of redis-server once the runs' claims are on its AOF."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, Broker, answered_once, broker, ingest, stack_env
from tests.services import gateway
from worker.processes.stack import child_env, worker_process

ITEMS = 6  # one chunk's worth, all in their model call at once
HELD = 10**9  # the fake answers nothing until this many calls came in: held until lowered


@dataclass
class OutageStack:
    model: FakeAnthropic
    broker: Broker
    url: str  # the job store's Redis URL
    client: httpx.Client  # the gateway's, the sample documents ingested
    log: Path  # the worker's log

    def search(self, search_id: str) -> dict[str, object]:
        response = self.client.get(f"/v1/searches/{search_id}", headers=ACME)
        response.raise_for_status()
        body: dict[str, object] = response.json()
        return body

    def logged(self, line: str) -> int:
        """How many times the worker's log holds ``line``."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count(line)

    def down_while_held(self) -> None:
        """Kill redis-server once what was written (the runs' claims) is on its AOF."""
        direct = redis.Redis.from_url(self.url)
        try:
            self.broker.written(direct)
        finally:
            direct.close()
        self.broker.kill(signal.SIGKILL)


@contextmanager
def outage_stack(tmp_path: Path, **extra: str) -> Iterator[OutageStack]:
    """A worker and a gateway at the defaults over a restartable redis-server, the fake
    model holding every call (:data:`HELD`), the sample documents ingested; ``extra``: the
    settings a test sets."""
    with (
        FakeAnthropic(hold_until_received=HELD) as model,
        broker(tmp_path / "redis") as redis_broker,
    ):
        url = redis_broker.url + "/0"
        env = stack_env(url, model.url, **extra)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # the defaults, as a user runs them
        env.pop("SIFT_WEBHOOK_RETRY_SCALE")
        env = child_env(env, inherit_sift=False)
        with (
            worker_process(tmp_path / "w", env),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            answered_once(client, model)  # the test holds the model's answers from here
            yield OutageStack(model, redis_broker, url, client, tmp_path / "w" / "worker.log")
