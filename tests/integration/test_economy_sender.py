"""Which ``sift worker`` says, at its beats, that it can send economy batches
(``sift:economy-sender``): one with a generation model that consumes the batch queue, where
the economy lane's submission goes. A worker without the model past the economy deadline
ends the items never sent only while no such worker lives
(:mod:`worker.queue.economy.submission`), so one that never takes the submission (started
with ``--queues`` leaving ``sift.batch`` out) must not count, nor one without the model,
nor one told at run time to stop consuming it (``celery control cancel_consumer
sift.batch``): it counted until it stopped, its beats setting the mark from the queues it was
started with, so a worker without the model left the items never sent waiting for it.

Real redis-server and ``sift worker`` processes (no call is made: the model is never asked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.economy import batch_queue_control, without_model
from tests.reliability.support import stack_env, wait_for
from tests.services import redis_server
from worker.constants import ECONOMY_SENDER_KEY, SEARCH_QUEUE, WORKER_HEARTBEAT_KEY
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_only_a_worker_with_the_model_and_the_batch_queue_says_it_can_send(
    tmp_path: Path,
) -> None:
    with FakeAnthropic() as model, redis_server(tmp_path / "redis") as base_url:
        env = stack_env(base_url + "/0", model.url)
        client = redis.Redis.from_url(base_url + "/0", decode_responses=True)
        beating = lambda: len(list(client.scan_iter(WORKER_HEARTBEAT_KEY + "*")))  # noqa: E731
        with (
            worker_process(tmp_path / "w", child_env(env, inherit_sift=False), "searches",
                           queues=SEARCH_QUEUE),
            worker_process(tmp_path / "w", child_env(without_model(env), inherit_sift=False),
                           "nomodel"),
        ):  # fmt: skip
            wait_for(lambda: beating() == 2, "both workers' heartbeats", 60)
            assert client.get(ECONOMY_SENDER_KEY) is None
            with worker_process(tmp_path / "w", child_env(env, inherit_sift=False), "model"):
                wait_for(lambda: beating() == 3, "the third worker's heartbeat", 60)
                assert client.get(ECONOMY_SENDER_KEY) == "claude-haiku-4-5"
                ttl_ms = client.pttl(ECONOMY_SENDER_KEY)
                assert 0 < ttl_ms <= 10_000, ttl_ms  # SIFT_WORKER_DEAD_AFTER_SECONDS' default
                # told to stop consuming the batch queue: its mark expires, its heartbeat lives
                batch_queue_control(base_url + "/0", tmp_path / "w", "model", consume=False)
                gone = "the mark of a worker no longer consuming the batch queue gone"
                wait_for(lambda: client.get(ECONOMY_SENDER_KEY) is None, gone, 60)
                assert beating() == 3
                # told to consume it again: it says so again at its next beat
                batch_queue_control(base_url + "/0", tmp_path / "w", "model", consume=True)
                back = "the mark back with the batch queue"
                wait_for(lambda: client.get(ECONOMY_SENDER_KEY) == "claude-haiku-4-5", back, 30)
        client.close()
