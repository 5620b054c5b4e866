"""An economy batch's hashes live as long as its record: none has a TTL while the batch runs,
and the move that completes it gives each the retention (worker/queue/jobstore/lanes.py)."""

from __future__ import annotations

import time

from tests.fake_anthropic import FakeAnthropic
from tests.integration.test_economy_doubts import (
    _mapping,
    _prepared,
    _Task,
    context,
    model,
    workers,
)
from worker.constants import (
    BATCH_KEY,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
    STATS_KEY,
)
from worker.queue.base import WorkerContext
from worker.queue.economy import submission
from worker.queue.economy.watch import rewake

__all__ = ["context", "model", "workers"]  # fixtures (test_economy_doubts.py's)


def test_an_economy_batch_outliving_the_retention_still_ends(
    context: WorkerContext, model: FakeAnthropic, workers: None
) -> None:
    """Its workers stopped for longer than the retention (2 s here, as if 2..90 days): the
    economy hashes expired under the running batch, its submission then sent nothing and its
    items stayed ``running`` (and counted) for good. They live as its record does now."""
    store = context.store
    store.result_ttl = 2
    batch, _ = _prepared(context, 3)
    store.economy_expect(batch.id, "submit", time.time() + 1)  # the chunk's claim of the submit
    time.sleep(3)  # the retention passes with every worker stopped
    r = store.redis
    assert r.ttl(ECONOMY_PREPARED_KEY + batch.id) == -1
    sent: list[str] = []
    rewake(store, lambda name, args, queue, tid: sent.append(tid), time.time() + 3600)
    submission._submit(_Task(context, sent[0]), batch.id)  # type: ignore[arg-type]
    (provider,) = model.batches()
    assert r.ttl(ECONOMY_PROVIDERS_KEY + batch.id) == -1
    assert r.ttl(ECONOMY_RUNS_KEY + batch.id) == -1

    _mapping(context, batch, provider["id"])

    done = store.get_batch(batch.id)
    assert done is not None and done.finished_at is not None
    assert done.counts["succeeded"] == 3
    assert int(r.hget(STATS_KEY, "running") or 0) == 0
    for key in (BATCH_KEY, ECONOMY_RUNS_KEY, ECONOMY_PROVIDERS_KEY, ECONOMY_STATE_KEY):
        assert 0 < r.ttl(key + batch.id) <= 2, key  # the retention, from the completion
