"""A provider outage under a reranked batch, on a real stack at the default settings
(redis-server, ``sift worker``, the gateway, the fake Messages API over HTTP): the model
answers 529 (overloaded, no ``retry-after``) to every call for 8 s.

The shared rate budget's breaker (``worker/adapters/rate_budget``) stops the cluster sending
after the first 529s, sends one probe at a time (after 1 s, then 2, 4, 8 s), and lets
everyone go again once a probe is answered: the items wait within their deadline instead of
spending their retry budget on a provider that is down. Before it, every item sent its three
attempts into the outage within a few seconds and failed ``rerank_failed``.

The deployment has had an answer before the outage (a one-item batch): its very first call is
the budget's learner, sent alone, and one meeting an outage is the only search in flight,
which goes as each probe and may spend its attempts on them (docs/queue.md).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    batch_counts,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker, gateway, redis_server

pytestmark = pytest.mark.integration

ITEMS = 100
OUTAGE_SECONDS = 8.0


@pytest.mark.timeout(300)
def test_a_529_outage_shorter_than_the_deadline_fails_no_item_and_is_probed_not_flooded(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path / "redis") as url, FakeAnthropic() as model:
        env = stack_env(url + "/0", model.url)
        env.pop("SIFT_GENERATION_MAX_REQUESTS")  # every setting at its default
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w"),
        ):
            ingest(client)
            first = submit_batch(client, 1)  # the deployment's first answer: it states no limit
            wait_for(lambda: batch_counts(client, first)["finished_at"] is not None, "first", 60)
            model.reset()
            model.outage(OUTAGE_SECONDS, (529,))
            batch_id = submit_batch(client, ITEMS)
            wait_for(
                lambda: batch_counts(client, batch_id)["finished_at"] is not None,
                "the batch finished",
                120,
            )
            done = batch_counts(client, batch_id)
    assert done["counts"]["succeeded"] == ITEMS, done["counts"]
    overloaded = model.counts()["statuses"].get("529", 0)
    # the first calls of the items in flight when it began, then a probe every 1, 2, 4, 8 s:
    # not every item's three attempts (300)
    assert overloaded <= ITEMS + 6, model.counts()
    assert done["usage"]["requests"] == model.counts()["received"], (done["usage"], model.counts())
