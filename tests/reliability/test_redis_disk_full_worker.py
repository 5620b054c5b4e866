"""A worker on a Redis that cannot persist to its disk keeps running, and consumes again
once Redis can write.

Redis whose AOF write or RDB save failed (a full disk, most often) refuses every write, and
PING, with ``MISCONF`` until a write to its disk succeeds. The consumer's ``BRPOP`` is a write:
kombu raised the plain ``ResponseError``, which is no connection error to Celery, and every
worker process stopped ("Unrecoverable error", exit 0), again at each restart the supervisor
made while the disk stayed full. :class:`worker.queue.broker.CannotPersist` makes it a lost
connection: Celery reconnects with its back-off.

A real ``sift worker`` at the defaults (its processes under the supervisor), a real gateway
and the fake model, on a real redis-server whose save is made to fail.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, broker, ingest, stack_env, submit_search, wait_for
from tests.services import gateway, unable_to_persist
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

# what Celery's consumer logs when it takes an error for a lost connection, and when not
LOST, UNRECOVERABLE = "Connection to broker lost", "Unrecoverable error"


def _succeeded(client: httpx.Client, job_id: str) -> bool:
    return client.get(f"/v1/searches/{job_id}", headers=ACME).json()["status"] == "succeeded"


@pytest.mark.timeout(300)
def test_a_worker_rides_out_a_redis_that_cannot_persist(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    with broker(tmp_path / "redis") as redis_broker:
        env = child_env(stack_env(redis_broker.url + "/0", model.url), inherit_sift=False)
        log = tmp_path / "w" / "worker.log"
        with (
            worker_process(tmp_path / "w", env, processes=None) as worker,  # the defaults
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            redis.Redis.from_url(redis_broker.url + "/0") as r,
        ):
            ingest(client)
            before = submit_search(client, "who beat Kasparov")
            wait_for(lambda: _succeeded(client, before), "a search before")
            start = len(log.read_text(errors="replace"))
            with unable_to_persist(r):
                with pytest.raises(redis.ResponseError, match=r"^MISCONF"):
                    r.set("probe", "1")  # the refusal is real

                def met() -> bool:
                    text = log.read_text(errors="replace")[start:]
                    return LOST in text or UNRECOVERABLE in text

                wait_for(met, "the worker meeting the refusal")
            after = submit_search(client, "who beat Kasparov")  # Redis can write again
            wait_for(lambda: _succeeded(client, after), "a search after")
            text = log.read_text(errors="replace")[start:]
            assert UNRECOVERABLE not in text, text[text.find(UNRECOVERABLE) :][:3000]
            assert "restarting it" not in text and "exited" not in text, text[-3000:]
            assert worker.poll() is None
