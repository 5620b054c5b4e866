"""A deployment's first batch at the default settings (no ``SIFT_RATE_LIMITS``), on a real stack
(redis-server, ``sift worker`` with two Celery processes, the gateway, the fake Messages API
over HTTP metering 60 requests a minute and stating its limits in every answer's headers, as
Anthropic's does).

No process knows the limits until an answer states them: the shared rate budget
(``worker/adapters/rate_budget``) sends one call alone, the learner, and holds every other
call, and the batch's pacing, until its answer taught the limits; from then on the budget
meters the batch at them. The batch is larger than the tier serves within a search's deadline
(30 s), so its items must be paced, not started at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    batch_counts,
    ingest,
    sample_queries,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.services import gateway, redis_server
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

RPM = 60  # the fake's bucket holds 60 requests, then refills one a second
ITEMS = 84  # the tier serves about 83 within a deadline: 54 at once (Sift's 90%), then 1/s
MODEL_SECONDS = 0.3


@contextmanager
def stack(tmp_path: Path, model: FakeAnthropic) -> Iterator[httpx.Client]:
    """A gateway's client on a fresh Redis, the sample corpus ingested, and a worker of two
    processes, every setting at its default but the fake model's address."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            worker_process(tmp_path / "w", child_env(env, inherit_sift=False), processes=2),
        ):
            ingest(client)
            yield client


@pytest.mark.timeout(300)
def test_a_first_batch_without_rate_limits_set_is_paced_on_the_limits_its_first_answer_states(
    tmp_path: Path,
) -> None:
    """Every item succeeds, the provider answers no 429, and the first call went out alone:
    the second came in after the first was answered. Every item started at once, before any
    answer, the provider answers 45 of the calls 429, and 4 or 5 items end ``rerank_failed``
    (their retries answered 429 too, or held past their deadline by the limits learned
    meanwhile: ``budget_exhausted``)."""
    with FakeAnthropic(delay=MODEL_SECONDS, rpm=RPM) as model:
        with stack(tmp_path, model) as client:
            batch_id = submit_batch(client, ITEMS)
            wait_for(
                lambda: batch_counts(client, batch_id)["finished_at"] is not None,
                "the batch finished",
                240,
            )
            done = batch_counts(client, batch_id)
        counts, requests = model.counts(), model.requests()
    assert done["counts"]["succeeded"] == ITEMS, (done["counts"], counts)
    assert model.rate_limited() == 0, counts
    assert counts["statuses"] == {"200": ITEMS}, counts
    first, second = sorted(r["monotonic"] for r in requests)[:2]
    assert second >= first + MODEL_SECONDS, (first, second)  # the learner's answer came first


@pytest.mark.timeout(240)
def test_a_batch_that_reranks_nothing_does_not_wait_for_the_learner(tmp_path: Path) -> None:
    """A batch of searches that do not rerank (``"rerank": false``) makes no model call: its
    items are not paced on the rate budget, so they never wait for the learner. A reranked
    search is out learning the limits (the fake holds its answer until a second request
    comes in), and the batch finishes meanwhile: the fake received that one request only,
    and answered none. Paced, each item waited for the learner's place (a day's backlog
    while it is out), then took it in turn, one at a time: the batch finished only once the
    learner's attempt had timed out (20 s) and its retry was answered."""
    with FakeAnthropic(rpm=RPM) as model:
        model.configure(hold_until_received=2)
        with stack(tmp_path, model) as client:
            submit_search(client, sample_queries()[0])  # reranked: the learner
            wait_for(lambda: model.counts()["received"] == 1, "the learner's call came in", 60)
            batch_id = submit_batch(client, 20, rerank=False)
            wait_for(
                lambda: batch_counts(client, batch_id)["finished_at"] is not None,
                "the batch finished",
                120,
            )
            counts = model.counts()
            done = batch_counts(client, batch_id)
            model.configure(hold_until_received=0)
    assert done["counts"]["succeeded"] == 20, done["counts"]
    assert counts["received"] == 1 and counts["statuses"] == {}, counts
