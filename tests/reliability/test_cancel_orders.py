"""Cancel in orders :mod:`tests.reliability.test_cancel` does not make, on a real stack at
default settings (redis-server, ``sift worker`` processes, the gateway, the fake Messages API
over HTTP): two cancels at once, and a cancel before or after a SIGTERMed worker hands its
chunk back. Each time the batch's status, its counts, its result lines, its one
``batch.completed`` webhook and ``sift_jobs_completed_total`` (the gateway's and the
workers', summed) agree.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    INDEX,
    Receiver,
    all_results,
    answered_once,
    batch_counts,
    ingest,
    sample_queries,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.services import free_port, gateway, http_get, redis_server
from worker.constants import RATE_BUDGET_KEY
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

FINAL = ("succeeded", "failed", "canceled")
Counters = dict[tuple[str, str], float]


class OrderStack(NamedTuple):
    env: dict[str, str]  # every process's environment: reliability settings at their defaults


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[OrderStack]:
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", "http://127.0.0.1:1")  # the model's URL: per test
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # back to its default
        yield OrderStack(env)


@contextmanager
def running(
    tmp: Path, stack: OrderStack, model: FakeAnthropic
) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    """The gateway against ``model``, the sample ingested and the deployment's first answer
    had (:func:`answered_once`: the tests hold the model's answers); yields its client and
    the workers' environment."""
    env = {**stack.env, "ANTHROPIC_BASE_URL": model.url}
    with gateway(tmp / "g", env) as base, httpx.Client(base_url=base, timeout=30) as client:
        ingest_worker = {**env, "SIFT_WORKER_METRICS_PORT": "0"}
        with worker(tmp / "ingest", ingest_worker, "ingest"):
            ingest(client)
            answered_once(client, model)
        yield client, env


@contextmanager
def worker(
    tmp: Path, env: dict[str, str], name: str, metrics_port: int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``sift worker`` at its default concurrency and pool, its metrics on ``metrics_port``."""
    if metrics_port is not None:
        env = {**env, "SIFT_WORKER_METRICS_PORT": str(metrics_port)}
    with worker_process(tmp, child_env(env, inherit_sift=False), name) as proc:
        yield proc


def completed(url: str) -> Counters:
    """``sift_jobs_completed_total`` by (kind, status), as ``url`` serves it now."""
    out: Counters = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        if family.name == "sift_jobs_completed":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["kind"], sample.labels["status"])
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def add(*counters: Counters) -> Counters:
    out: Counters = {}
    for one in counters:
        for key, value in one.items():
            out[key] = out.get(key, 0.0) + value
    return out


def cancel(client: httpx.Client, batch_id: str) -> httpx.Response:
    return client.delete(f"/v1/batches/{batch_id}", headers=ACME)


def finished(client: httpx.Client, batch_id: str, timeout: float = 120) -> dict[str, Any]:
    wait_for(
        lambda: batch_counts(client, batch_id)["finished_at"] is not None, "batch finished", timeout
    )
    return batch_counts(client, batch_id)


def webhook_statuses(receiver: Receiver, batch_id: str) -> list[str]:
    """The status each ``batch.completed`` delivery said, once one came and a second could."""
    wait_for(lambda: bool(receiver.for_job(batch_id)), "the batch webhook", 60)
    time.sleep(2.0)
    return [d.body["data"]["status"] for d in receiver.for_job(batch_id)]


def assert_told_alike(client: httpx.Client, batch: dict[str, Any], receiver: Receiver) -> None:
    """The counts add up, match the result lines, the status follows from them, it is what
    the listing (filtered by it) says, and the one webhook says it too."""
    counts = batch["counts"]
    assert counts["queued"] == counts["running"] == 0, counts
    assert sum(counts[s] for s in FINAL) == counts["total"], counts
    results = all_results(client, batch["id"])
    assert len(results) == counts["total"]
    for status in FINAL:
        assert sum(r["status"] == status for r in results) == counts[status], status
    assert batch["status"] == ("canceled" if counts["canceled"] else "succeeded")
    listed = client.get("/v1/batches", params={"status": batch["status"]}, headers=ACME).json()
    fields = ("status", "counts", "canceled_at", "finished_at")
    assert [{k: b[k] for k in fields} for b in listed["batches"] if b["id"] == batch["id"]] == [
        {k: batch[k] for k in fields}
    ]
    assert webhook_statuses(receiver, batch["id"]) == [batch["status"]]


def assert_counted_once(counted: Counters, batch: dict[str, Any]) -> None:
    """``sift_jobs_completed_total``: the batch once, by its status; each canceled item once."""
    batches = {k[1]: v for k, v in counted.items() if k[0] == "batch" and v}
    assert batches == {batch["status"]: 1.0}, counted
    assert counted.get(("batch_item", "canceled"), 0.0) == batch["counts"]["canceled"], counted


@pytest.mark.timeout(300)
def test_two_cancels_at_once_cancel_each_item_once_and_agree(
    tmp_path: Path, stack: OrderStack, receiver: Receiver
) -> None:
    """Two cancels sent at the same instant while every running item waits on the model:
    both answer ``200`` (the batch is not finished), the queued items are canceled once,
    the held ones finish, and the batch ends ``canceled`` with one webhook saying so, the
    batch counted once and each canceled item once. The same request sent again with its
    ``Idempotency-Key`` then answers that batch as it is, and makes none."""
    port = free_port()
    queries = sample_queries()
    body = {
        "index": INDEX,
        "rerank": True,
        "webhook_url": receiver.url,
        "queries": [{"id": f"q{i:05d}", "query": queries[i % len(queries)]} for i in range(400)],
    }
    keyed = {**ACME, "Idempotency-Key": "cancel-orders-1"}
    with (
        FakeAnthropic(hold_unscripted=True) as model,
        running(tmp_path, stack, model) as (client, env),
        worker(tmp_path / "w", env, "w", port),
    ):
        metrics = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: http_get(metrics, timeout=10).is_success, "worker metrics", 60)
        made = client.post("/v1/batches", json=body, headers=keyed)
        assert made.status_code == 202, made.text
        batch_id = made.json()["id"]
        wait_for(lambda: len(model.requests()) >= 8, "items held at the model")
        before = add(completed(metrics), completed(str(client.base_url) + "/metrics"))
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: cancel(client, batch_id), range(2)))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        model.configure(hold_unscripted=False)
        done = finished(client, batch_id)
        assert done["status"] == "canceled", done
        assert_told_alike(client, done, receiver)
        after = add(completed(metrics), completed(str(client.base_url) + "/metrics"))
        counted = {k: v - before.get(k, 0.0) for k, v in after.items()}
        assert_counted_once(counted, done)
        assert counted.get(("batch_item", "succeeded"), 0.0) == done["counts"]["succeeded"]
        again = client.post("/v1/batches", json=body, headers=keyed)
        assert again.status_code == 202, again.text
        assert again.json() == batch_counts(client, batch_id)  # that batch, canceled
        listed = client.get("/v1/batches", headers=ACME).json()["batches"]
        assert [b["id"] for b in listed].count(batch_id) == 1 and len(listed) == 1


@pytest.mark.timeout(400)
def test_a_cancel_after_a_sigterm_hand_back_ends_the_batch_once(
    tmp_path: Path, stack: OrderStack, receiver: Receiver
) -> None:
    """A worker SIGTERMed mid-batch hands its chunks back (their items not started stay
    ``queued``, their messages back on the queue); the cancel comes with no worker left and
    cancels them. Another worker then takes the handed-back chunks: nothing is left to run,
    no second webhook is sent, and the batch is counted once, ``canceled``."""
    port = free_port()
    with FakeAnthropic(delay=1.0) as model, running(tmp_path, stack, model) as (client, env):
        gateway_metrics = str(client.base_url) + "/metrics"
        before = completed(gateway_metrics)
        with worker(tmp_path / "a", env, "a") as worker_a:
            batch_id = submit_batch(client, 600, webhook_url=receiver.url)
            wait_for(lambda: batch_counts(client, batch_id)["counts"]["succeeded"] >= 20, "20 done")
            worker_a.send_signal(signal.SIGTERM)
            worker_a.wait(60)
        handed = batch_counts(client, batch_id)
        assert handed["counts"]["queued"] > 0 and handed["counts"]["running"] == 0, handed
        answer = cancel(client, batch_id)
        assert answer.status_code == 200, answer.text
        with worker(tmp_path / "b", env, "b", port):
            done = finished(client, batch_id)
            assert done["status"] == "canceled", done
            assert_told_alike(client, done, receiver)
            seen_b = completed(f"http://127.0.0.1:{port}/metrics")
        gateway_counted = {k: v - before.get(k, 0.0) for k, v in completed(gateway_metrics).items()}
        # worker A canceled nothing and did not complete the batch (its items went back
        # queued): it counted no cancel's item, and its counters are gone with it
        assert_counted_once(add(gateway_counted, seen_b), done)


@pytest.mark.timeout(300)
def test_a_cancel_reaches_the_items_waiting_out_a_429_before_their_next_call(
    tmp_path: Path, stack: OrderStack, receiver: Receiver
) -> None:
    """The provider answers 429 with ``retry-after: 3``: every item of the batch waits, on
    the shared rate budget's pause or its own back-off, before its next call. A cancel then
    reaches each of them before that call: the batch ends ``canceled`` with every item
    canceled and no call sent after the cancel. Before, the check ran once, before an
    item's first attempt: the waiting items went on calling (180 calls after the cancel,
    100 of them billed, in the review's run) and the batch ended ``succeeded``."""
    with FakeAnthropic() as model, running(tmp_path, stack, model) as (client, env):
        with worker(tmp_path / "w", env, "w"):
            model.outage(600, (429,), retry_after=3)
            batch_id = submit_batch(client, 100, webhook_url=receiver.url)
            wait_for(lambda: model.counts()["received"] >= 10, "items answered 429")
            answer = cancel(client, batch_id)
            assert answer.status_code == 200, answer.text
            canceled_at = time.time()
            model.outage(0)  # the provider is back: a call sent now would be answered, billed
            done = finished(client, batch_id)
            assert_told_alike(client, done, receiver)
        # an item that read the batch's mark just before the cancel (the process's view is
        # at most 0.1 s old) may send in the instant after it; none later (before: 3-12 s)
        late = [r for r in model.requests() if r["time"] > canceled_at + 1.0]
        assert late == [], f"{len(late)} calls sent after the cancel"
        answered = model.counts()["statuses"].get("200", 0)  # those, after the outage ended
        assert done["counts"]["succeeded"] == answered, (done["counts"], model.counts())
        assert done["counts"]["canceled"] == 100 - answered >= 50, done["counts"]


@pytest.mark.timeout(300)
def test_a_cancel_reaches_the_items_waiting_for_a_place_in_flight(
    tmp_path: Path, stack: OrderStack, receiver: Receiver
) -> None:
    """The worker keeps 2 model calls in flight (``SIFT_RERANK_MAX_IN_FLIGHT``): 2 items of
    a batch of 10 are in their calls, which the model holds, and 8 wait for a place. A
    cancel then reaches the 8 while they wait: they end ``canceled`` before any place frees,
    the 2 in their calls finish, and the model is sent 2 calls in all. Before, the wait for
    a place asked nothing: once the model answered, the 8 took the places and made their
    calls, billed, and the batch ended ``succeeded`` with nothing canceled."""
    model = FakeAnthropic(hold_unscripted=True)
    with model, running(tmp_path, stack, model) as (client, env):
        with worker(tmp_path / "w", {**env, "SIFT_RERANK_MAX_IN_FLIGHT": "2"}, "w"):
            batch_id = submit_batch(client, 10, webhook_url=receiver.url)
            wait_for(lambda: model.counts()["received"] == 2, "two calls at the model")
            wait_for(lambda: batch_counts(client, batch_id)["counts"]["running"] == 10, "started")
            answer = cancel(client, batch_id)
            assert answer.status_code == 200, answer.text
            wait_for(
                lambda: batch_counts(client, batch_id)["counts"]["canceled"] == 8,
                "the cancel reaching the items waiting for a place",
                30,
            )
            model.configure(hold_unscripted=False)  # the 2 calls answered
            done = finished(client, batch_id)
            assert_told_alike(client, done, receiver)
        assert model.counts()["received"] == 2, model.counts()
    assert done["counts"]["succeeded"] == 2 and done["counts"]["canceled"] == 8, done["counts"]


@pytest.mark.timeout(300)
def test_a_cancel_reaches_the_items_paced_while_the_breaker_is_open(
    tmp_path: Path, stack: OrderStack, receiver: Receiver
) -> None:
    """A search's call answered 529 with ``retry-after: 60`` opens the shared rate budget's
    breaker for a minute. A batch submitted then starts its 10 items, which pace (a batch
    item waits for the budget before its search and its deadline start) while it is open.
    A cancel reaches them there: every item ends ``canceled`` while the breaker is still
    open, and the model is sent nothing more. Before, the pacing asked only whether the
    worker was stopping: the items saw the cancel once the opening was over (59 s after
    the cancel in the review's run), the batch ``running`` until then."""
    budget = redis.Redis.from_url(stack.env["SIFT_REDIS_URL"], decode_responses=True)
    key = RATE_BUDGET_KEY + "standard:claude-haiku-4-5"

    def breaker_open() -> bool:  # on Redis's clock, as the budget's script reads it
        seconds, micros = budget.time()
        return float(budget.hget(key, "open") or 0) > seconds + micros / 1e6

    with FakeAnthropic() as model, running(tmp_path, stack, model) as (client, env):
        with worker(tmp_path / "w", env, "w"):
            model.outage(600, (529,), retry_after=60)
            submit_search(client, sample_queries()[0])
            wait_for(lambda: model.counts()["received"] == 1, "the search's call answered 529")
            wait_for(breaker_open, "the breaker opened")
            batch_id = submit_batch(client, 10, webhook_url=receiver.url)
            wait_for(lambda: batch_counts(client, batch_id)["counts"]["running"] == 10, "started")
            answer = cancel(client, batch_id)
            assert answer.status_code == 200, answer.text
            done = finished(client, batch_id)
            assert breaker_open(), "the items saw the cancel only once the breaker was over"
            assert_told_alike(client, done, receiver)
        assert model.counts()["received"] == 1, model.counts()
    budget.close()
    assert done["counts"]["canceled"] == 10, done["counts"]
