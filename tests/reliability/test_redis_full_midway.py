"""Redis (``noeviction``) reaching its ``maxmemory`` while a batch's items are in their model
calls: the answers come back and Redis refuses their finishes, then the chunk tasks' acks.

kombu's ack is a ``MULTI`` of two deletes, and Redis refuses every command queued in a
``MULTI`` at its limit: the ack raised, Celery's worker stopped ("Unrecoverable error"), and
the batch stayed ``running`` for good, its items ``running`` with nothing to run them. With
the ack through (:class:`worker.queue.broker.QoS`) the chunk's run claim still held its
positions from the re-drive for its lease (770 s), Redis refusing its release too: the
batch was still ``running`` 390 s after Redis had room. The release runs at the limit now
(``allow-oom``): once Redis has room again the re-drive sends the items left ``running``
once more, and the batch ends ``succeeded``, its counts and its webhook saying so. Each
model answer is kept with its run claim at the limit too (``allow-oom``), so the runs sent
again finish on it: the model is asked once an item. It was asked again (77 requests for the
40 items), the first answers' usage shown nowhere.

At the defaults, no setting shortened (the re-drive: a few minutes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.reliability.support import (
    ACME,
    FINISH_TIMEOUT,
    Receiver,
    answered_once,
    gateway_stack,
    ingest,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker

pytestmark = pytest.mark.integration

ITEMS = 40  # some 4 kB of results each: well past the room left


def _refused_for_oom(client: redis.Redis) -> int:
    return int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


@pytest.mark.timeout(900)
def test_a_batch_whose_finishes_meet_a_full_redis_ends_once_it_has_room(
    tmp_path: Path, receiver: Receiver
) -> None:
    with (
        gateway_stack(tmp_path, model_delay=0.0) as stack,
        celery_worker(tmp_path / "w", stack.env, "w1") as worker,
        redis.Redis.from_url(stack.redis_url) as r,
    ):
        assert stack.model is not None
        model, client = stack.model, stack.client
        ingest(client)
        answered_once(client, model)  # the deployment's first answer, before the hold
        model.configure(hold_until_received=ITEMS)  # every item in its model call at once
        batch_id = submit_batch(client, ITEMS, webhook_url=receiver.url)
        wait_for(lambda: model.counts()["received"] == ITEMS, "every item in its call")
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 50_000)
        model.configure(hold_until_received=0)  # the answers come back to a full Redis

        def ended_and_acked() -> bool:
            return _refused_for_oom(r) > 0 and r.hlen("unacked") == 0

        wait_for(ended_and_acked, "the chunks' runs refused for OOM, then acked")
        assert worker.poll() is None, "the worker stopped"
        stuck = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
        assert stuck["status"] == "running" and stuck["counts"]["running"] > 0, stuck

        r.config_set("maxmemory", 0)  # room again (as finished jobs expire)

        def final() -> bool:
            body = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
            return body["status"] not in ("queued", "running")

        wait_for(final, "the batch's end", FINISH_TIMEOUT)
        done = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
        assert done["status"] == "succeeded", done
        assert done["counts"]["succeeded"] == ITEMS, done
        # each answer was kept with its run claim at the limit: the runs sent again finish on
        # it, none calls the model again
        assert model.counts()["received"] == ITEMS, model.counts()
        wait_for(lambda: receiver.for_job(batch_id), "the batch's webhook")
        [hook] = receiver.for_job(batch_id)
        assert hook.body["data"]["status"] == "succeeded", hook.body
        assert hook.body["data"]["counts"] == done["counts"], hook.body
        assert worker.poll() is None
