"""The economy lane when a chunk message is lost before any worker took it, at default
settings (the stack of :mod:`tests.reliability.economy`): its items still ``queued``, so no
submission can start; the re-drive sends it again, and one submission makes one provider
batch of every item. A file of its own: its wait on the re-drive's stall is the longest of
any test, and ``make test`` starts it first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.economy import economy_stack, finished, submit_economy, worker
from tests.reliability.support import assert_batch_exactly_once, ingest, wait_for
from worker.queue.economy import position_of
from worker.queue.redrive import coverage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _lose_chunk(client: redis.Redis, batch_id: str) -> list[int]:
    """Take one chunk message of the batch out of the broker's queue (lost, as kombu's
    pop-then-record window loses one); answers its ``[start, stop)``."""
    for queue in client.keys("sift.*"):
        if client.type(queue) != "list":
            continue
        for raw in client.lrange(queue, 0, -1):
            found = coverage(json.loads(raw))
            if found is not None and found.job_id == batch_id:
                assert client.lrem(queue, 1, raw) == 1
                return [found.positions.start, found.positions.stop]
    raise AssertionError("no chunk message of the batch in the broker")


def test_a_lost_chunk_message_is_sent_again_and_makes_one_submission(tmp_path: Path) -> None:
    # The batch is submitted while no worker runs, and one of its two chunk messages is lost
    # before any worker takes it: its items stay queued, the other chunk's are prepared, and
    # no submission can start. The re-drive's sweep (stall 120 s, two sweeps 30 s apart, at
    # the defaults) sends the lost chunk again; one submission follows, one provider batch.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        with worker(tmp_path / "w", env, "a"):
            ingest(client)
        batch_id = submit_economy(client, 30)  # two chunks of the default 25
        assert _lose_chunk(broker, batch_id) in ([0, 25], [25, 30])
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", 400)
        log = (tmp_path / "w" / "b.log").read_text(errors="replace")
        assert "on two sweeps; re-driven" in log
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 30)
        [made] = model.batches()  # every item in the one provider batch, sent once
        assert len(made["custom_ids"]) == 30
        assert {position_of(c) for c in made["custom_ids"]} == set(range(30))
