"""What a batch's cancel ends is counted in ``sift_jobs_completed_total`` once, whether the
gateway hears the cancel's answer or not: the count is a task message the cancel's own script
writes (the outbox), and the task takes it from the batch's record. The gateway counted from
the answer, so a cancel whose answer was lost (the gateway's 503, or a gateway killed right
after) left its items uncounted for good: a cancel sent again found them canceled already.

The gateway (in-process, real Redis) and the task (run in-process on the same registry) share
the counters, so a count made twice would show too."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from tests.integration.gateway_app import ACME
from worker.constants import BATCH_KEY, BATCH_QUEUE, ECONOMY_CANCEL_TASK, SEARCH_QUEUE
from worker.contract import SearchSpec
from worker.queue import base, tasks
from worker.queue.jobstore import JobStore
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration


@pytest.fixture
def worker(redis_url: str, store: JobStore) -> Iterator[None]:
    settings = load_settings(redis_url=redis_url)
    base.set_context(base.WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(1)))
    yield
    base.set_context(None)


def _completed(kind: str) -> float:
    labels = {"kind": kind, "status": "canceled"}
    return REGISTRY.get_sample_value("sift_jobs_completed_total", labels) or 0.0


def _deliver(store: JobStore) -> int:
    """Run the count messages waiting on the batch queue (twice each: a redelivery)."""
    runs = 0
    while (raw := store.redis.rpop(BATCH_QUEUE)) is not None:
        message = json.loads(raw)
        assert message["headers"]["task"] == "sift.cancel_count", message
        args, _, _ = json.loads(base64.b64decode(message["body"]))
        tasks.cancel_count.apply(args=args)
        tasks.cancel_count.apply(args=args)
        runs += 1
    return runs


def _batch(store: JobStore) -> str:
    spec = SearchSpec(index="docs", query="a")
    return store.create_batch("acme", "docs", [(f"q{i}", spec) for i in range(3)]).id


def _lose_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = JobStore.cancel_batch

    def lost(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        ran(self, *args, **kwargs)  # the cancel ran; its answer never came back
        monkeypatch.setattr(JobStore, "cancel_batch", ran)
        raise redis.ConnectionError("connection lost")

    monkeypatch.setattr(JobStore, "cancel_batch", lost)


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("resent", [False, True])
def test_a_cancel_whose_answer_was_lost_is_counted_once(
    client: TestClient, store: JobStore, monkeypatch: pytest.MonkeyPatch, resent: bool
) -> None:
    """Counted by the worker that takes the cancel's count message, or, if the client sends
    the cancel again first, by the gateway that answers it; never by both."""
    batch_id = _batch(store)
    items, batches = _completed("batch_item"), _completed("batch")
    _lose_the_answer(monkeypatch)
    assert client.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 503
    if resent:
        again = client.delete(f"/v1/batches/{batch_id}", headers=ACME)
        assert again.status_code == 200 and again.json()["status"] == "canceled", again.text
        assert _completed("batch_item") - items == 3
    assert _deliver(store) == 1
    assert _completed("batch_item") - items == 3
    assert _completed("batch") - batches == 1


@pytest.mark.usefixtures("worker")
def test_a_cancel_whose_answer_was_heard_is_counted_once_by_the_gateway(
    client: TestClient, store: JobStore
) -> None:
    batch_id = _batch(store)
    assert store.begin_item(batch_id, "q0").applied  # running: the batch stays open
    items, batches = _completed("batch_item"), _completed("batch")
    answer = client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert answer.status_code == 200 and answer.json()["counts"]["canceled"] == 2, answer.text
    assert _completed("batch_item") - items == 2  # at once, with no worker
    assert client.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
    assert _deliver(store) == 1  # the second cancel ended nothing: no message
    assert _completed("batch_item") - items == 2
    assert _completed("batch") - batches == 0


@pytest.mark.usefixtures("worker")
def test_a_take_whose_answer_the_gateway_never_heard_is_counted_once(
    client: TestClient, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's take ran, and its answer was lost with Redis down past the take's 5 s of
    retries: what it took is in no record any more, so the worker's count message finds
    nothing. The gateway takes again with the same token once Redis answers, which answers
    what the first take took. Before, it gave up: the 3 items and the batch never counted."""
    batch_id = _batch(store)
    items, batches = _completed("batch_item"), _completed("batch")
    ran = JobStore.take_cancel_count

    def lost(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        ran(self, *args, **kwargs)  # the take ran; its answer never came back
        monkeypatch.setattr(JobStore, "take_cancel_count", ran)
        raise redis.ConnectionError("connection lost")

    monkeypatch.setattr(JobStore, "take_cancel_count", lost)
    answer = client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert answer.status_code == 200 and answer.json()["status"] == "canceled", answer.text
    assert JobStore.take_cancel_count is ran  # the lost take did run
    assert _deliver(store) == 1
    # the gateway's take sent again, in a task of its own, after the answer
    deadline = time.monotonic() + 30
    while _completed("batch") - batches == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _completed("batch_item") - items == 3
    assert _completed("batch") - batches == 1


def test_a_take_sent_again_after_its_reply_was_lost_answers_what_it_took(
    store: JobStore,
) -> None:
    batch_id = _batch(store)
    assert store.cancel_batch(batch_id, count=("a-queue", "a message")) == (3, True)
    keys, token = [BATCH_KEY + batch_id], "t0ken"
    first = store._take_cancel_count(keys=keys, args=[token])
    assert first == store._take_cancel_count(keys=keys, args=[token]) == [3, 1]
    assert store.take_cancel_count(batch_id) == (0, False)  # another take: nothing left
    assert store.redis.lrange("a-queue", 0, -1) == ["a message"]


def test_a_take_sent_again_after_another_cancel_s_take_answers_what_it_took(
    store: JobStore,
) -> None:
    """A gateway sends its take again once Redis is back; a second cancel's take may have
    run meanwhile. The first take's answer must still be its own (it was the second's, so
    what the first took was never counted)."""
    batch_id = _batch(store)
    assert store.begin_item(batch_id, "q0").applied  # running: the batch stays open
    assert store.cancel_batch(batch_id, count=("a-queue", "m")) == (2, False)
    assert store.take_cancel_count(batch_id, "first") == (2, False)  # its reply lost
    assert store.requeue_item(batch_id, "q0")  # a retry's requeue, then a second cancel
    assert store.cancel_batch(batch_id, count=("a-queue", "m")) == (1, True)
    assert store.take_cancel_count(batch_id, "second") == (1, True)
    assert store.take_cancel_count(batch_id, "first") == (2, False)


@pytest.mark.usefixtures("worker")
def test_a_take_never_heard_past_the_retake_window_leaves_the_batch_s_figures_right(
    client: TestClient,
    store: JobStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway's take ran, its answer was lost, and every take sent again fails until
    the gateway gives up (``COUNT_RETAKE_SECONDS``, 10 minutes; shortened here): what the
    take took is not counted in ``sift_jobs_completed_total`` (the count message finds it
    taken), and the gateway logs that at ERROR. That is the metric alone: the batch's counts,
    its status and its ``finished_at`` are written by the cancel's own script, not by the
    take, so its ``GET`` (and its webhook, read from the same record) says 3 canceled."""
    from api_gateway.jobs import _cancel_count

    monkeypatch.setattr(_cancel_count, "COUNT_RETAKE_SECONDS", 0.5)
    batch_id = _batch(store)
    items = _completed("batch_item")
    ran = JobStore.take_cancel_count
    takes: list[str] = []

    def lost(self: JobStore, batch: str, token: str | None = None) -> Any:
        if not takes:
            ran(self, batch, token)  # the first take ran; its answer never came back
        takes.append(str(token))
        raise redis.ConnectionError("connection lost")

    monkeypatch.setattr(JobStore, "take_cancel_count", lost)
    answer = client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert answer.status_code == 200 and answer.json()["status"] == "canceled", answer.text
    deadline = time.monotonic() + 30
    while "may be left uncounted" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "may be left uncounted" in caplog.text and len(takes) >= 2
    assert len(set(takes)) == 1  # sent again with its own token
    monkeypatch.setattr(JobStore, "take_cancel_count", ran)
    assert _deliver(store) == 1  # the worker's count message: taken already, nothing
    assert _completed("batch_item") - items == 0  # the metric's loss, logged above
    got = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert got["status"] == "canceled" and got["finished_at"] is not None, got
    assert got["counts"] | {"total": 3} == {
        "total": 3, "queued": 0, "running": 0, "succeeded": 0, "failed": 0, "canceled": 3
    }  # fmt: skip


def _tasks(store: JobStore, queue: str) -> list[str]:
    return [json.loads(raw)["headers"]["task"] for raw in store.redis.lrange(queue, 0, -1)]


def test_an_economy_cancel_whose_answer_was_lost_still_cancels_its_provider_batches(
    client: TestClient, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel of an economy batch's provider batches is written by the cancel's own
    script, as its count is: the gateway sent it only once it had heard the answer, so a
    cancel whose answer was lost (a 503: Redis away, or the gateway dying after the script)
    left the provider processing, and billing, what the client had canceled, and items
    waiting on a create in doubt (which only that task ends) waiting up to 24 hours."""
    spec = SearchSpec(index="docs", query="a")
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec) for i in range(3)], lane="economy")
    assert store.begin_item(batch.id, "q0").applied  # waiting on its provider batch
    _lose_the_answer(monkeypatch)
    assert client.delete(f"/v1/batches/{batch.id}", headers=ACME).status_code == 503
    assert _tasks(store, SEARCH_QUEUE) == [ECONOMY_CANCEL_TASK]


def test_a_cancel_that_ends_an_economy_batch_sends_no_provider_cancel(
    client: TestClient, store: JobStore
) -> None:
    """Every item still queued: the cancel ends the batch, and no provider batch waits."""
    spec = SearchSpec(index="docs", query="a")
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec) for i in range(3)], lane="economy")
    answer = client.delete(f"/v1/batches/{batch.id}", headers=ACME)
    assert answer.status_code == 200 and answer.json()["status"] == "canceled", answer.text
    assert _tasks(store, SEARCH_QUEUE) == []
    assert _tasks(store, BATCH_QUEUE) == ["sift.cancel_count"]
