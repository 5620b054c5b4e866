"""A provider outage under a reranked batch, on a real stack at the default settings
(redis-server, ``sift worker``, the gateway, the fake Messages API over HTTP): the model
answers 529 (overloaded, no ``retry-after``) to every call for 8 s.

The shared rate budget's breaker (``worker/adapters/rate_budget``) stops the cluster sending
after the first 529s, sends one probe at a time (after 1 s, then 2, 4, 8 s), and lets
everyone go again once a probe is answered: the items wait within their deadline instead of
spending their retry budget on a provider that is down. Before it, every item sent its three
attempts into the outage within a few seconds and failed ``rerank_failed``. An outage longer
than the deadline fails the items whose calls met it, not the items still waiting for their
CPU slot (they pace again).

The deployment has had an answer before the outage (a one-item batch): its very first call is
the budget's learner, sent alone, and one meeting an outage is the only search in flight,
which goes as each probe and may spend its attempts on them (docs/queue.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    all_results,
    answered_once,
    batch_counts,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker, gateway, redis_server
from worker.runtime.slots import cpu_slots

pytestmark = pytest.mark.integration

ITEMS = 100
OUTAGE_SECONDS = 8.0


@contextmanager
def default_stack(tmp_path: Path) -> Iterator[tuple[FakeAnthropic, httpx.Client]]:
    """redis-server, the fake model, a gateway and one ``sift worker``, every setting at its
    default, the sample corpus ingested."""
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
            yield model, client


def finished(client: httpx.Client, batch_id: str, timeout: float) -> dict[str, Any]:
    """The batch once it has finished (its ``GET``), waited for up to ``timeout`` seconds."""
    wait_for(
        lambda: batch_counts(client, batch_id)["finished_at"] is not None,
        "the batch finished",
        timeout,
    )
    return batch_counts(client, batch_id)


@pytest.mark.timeout(300)
def test_a_529_outage_shorter_than_the_deadline_fails_no_item_and_is_probed_not_flooded(
    tmp_path: Path,
) -> None:
    with default_stack(tmp_path) as (model, client):
        first = submit_batch(client, 1)  # the deployment's first answer: it states no limit
        wait_for(lambda: batch_counts(client, first)["finished_at"] is not None, "first", 60)
        model.reset()
        model.outage(OUTAGE_SECONDS, (529,))
        batch_id = submit_batch(client, ITEMS)
        done = finished(client, batch_id, 120)
    assert done["counts"]["succeeded"] == ITEMS, done["counts"]
    overloaded = model.counts()["statuses"].get("529", 0)
    # the first calls of the items in flight when it began, then a probe every 1, 2, 4, 8 s:
    # not every item's three attempts (300)
    assert overloaded <= ITEMS + 6, model.counts()
    assert done["usage"]["requests"] == model.counts()["received"], (done["usage"], model.counts())


LONG_ITEMS = 900  # three of a worker process's item pools (300 at the defaults)
LONG_OUTAGE_SECONDS = 40.0  # past the 30 s default deadline
LONG_RETRY_AFTER = 45.0  # the breaker opens past any deadline: no item can wait it out
STARTED_AT_OUTAGE = 60  # items finished before the outage begins: the pool is full by then


@pytest.mark.timeout(300)
def test_an_outage_longer_than_the_deadline_fails_no_item_that_had_not_begun_its_search(
    tmp_path: Path,
) -> None:
    """The outage begins once the batch runs, its item pool full: 529s with a
    ``retry-after`` past the deadline, so the calls in flight open the breaker for 45 s.
    Those items fail (their deadline ends first); every item that had not begun its search
    waits, before its search and its deadline begin (waiting for its CPU slot included),
    until the breaker lets a call through. So only the items that had begun their search
    when the breaker opened may fail without a call sent: those holding a CPU slot then, or
    just out of one."""
    with default_stack(tmp_path) as (model, client):
        batch_id = submit_batch(client, LONG_ITEMS)
        wait_for(
            lambda: batch_counts(client, batch_id)["counts"]["succeeded"] >= STARTED_AT_OUTAGE,
            "the batch's first items succeeded",
            120,
        )
        model.outage(LONG_OUTAGE_SECONDS, (529,), retry_after=LONG_RETRY_AFTER)
        done = finished(client, batch_id, 240)
        failed = [r for r in all_results(client, batch_id) if r["status"] == "failed"]
    never_sent = [r for r in failed if not (r["error"].get("usage") or {}).get("requests")]
    assert len(failed) == done["counts"]["failed"], done["counts"]
    # the items that began their search while the breaker was open never sent a call, and
    # had no chance of one within their deadline: a few at most, those it opened under
    assert len(never_sent) <= 10 * cpu_slots(0).size, (
        len(never_sent), done["counts"], never_sent[:2],
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_a_provider_refusing_connections_for_less_than_the_deadline_fails_no_item(
    tmp_path: Path,
) -> None:
    """The provider unreachable, every connection refused (its host down, a proxy or a
    firewall in the way), for 8 s: an outage as a 5xx is, where no call is even sent. The
    calls refused open the breaker as a 5xx does, and the items wait within their deadline
    for a probe to get through, instead of spending their three attempts in a few seconds."""
    with default_stack(tmp_path) as (model, client):
        answered_once(client, model)  # the provider was reachable once: its limits known
        model.stop()
        batch_id = submit_batch(client, ITEMS)
        wait_for(
            lambda: batch_counts(client, batch_id)["counts"]["running"] > 0,
            "the batch's items running",
            60,
        )
        time.sleep(OUTAGE_SECONDS)
        model.start()
        done = finished(client, batch_id, 120)
        failed = [r for r in all_results(client, batch_id) if r["status"] == "failed"]
    assert done["counts"]["succeeded"] == ITEMS, (done["counts"], failed[:2])
    assert done["usage"]["requests"] == model.counts()["received"], (done["usage"], model.counts())
