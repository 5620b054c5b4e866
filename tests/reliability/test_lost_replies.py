"""A status change whose reply was lost still tells the truth, on a real stack at defaults.

The worker and the gateway reach Redis through :class:`~tests.reliability.replyloss.ReplyLoss`,
which lets one command through and breaks the connection before its reply comes back (a
Redis restart or a network blip at that instant). redis-py sends the command again on a new
connection; the job store's scripts must answer that second run as the first ran, or the
change is made and nobody hears of it: a search or batch finished with no webhook and no
count, a cancel that canceled the items answered ``409 already_finished``.

Each test checks that the job's status, its counts, its ``*.completed`` webhook and the
``sift_jobs_completed_total`` counters of the worker and the gateway agree.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.replyloss import ReplyLoss
from tests.reliability.support import (
    ACME,
    INDEX,
    Receiver,
    batch_counts,
    broker,
    ingest,
    sample_queries,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker, free_port, gateway, http_get, redis_server
from worker.constants import (
    BATCH_ITEMS_KEY,
    IDEMPOTENCY_PENDING_TTL_SECONDS,
    SEARCH_KEY,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.processes.stack import child_env, gateway_service, running
from worker.queue.config import celery_config
from worker.queue.jobstore.idempotency import _idem_key
from worker.queue.jobstore.scripts import _CANCEL_BATCH, _CREATE_SEARCH, _TAKE_CANCEL_COUNT
from worker.settings import load_settings

pytestmark = pytest.mark.integration

# what a script call that finishes a job or an item carries: its new status, and the ones it
# may come from
FINISHED = (b"EVALSHA", b"\r\nsucceeded\r\n", b"\r\nqueued,running\r\n")
CANCEL_SCRIPT = hashlib.sha1(_CANCEL_BATCH.encode()).hexdigest().encode()
TAKE_SCRIPT = hashlib.sha1(_TAKE_CANCEL_COUNT.encode()).hexdigest().encode()
CREATE_SEARCH_SCRIPT = hashlib.sha1(_CREATE_SEARCH.encode()).hexdigest().encode()


@dataclass
class LossStack:
    client: httpx.Client
    proxy: ReplyLoss
    worker_metrics: str
    model: FakeAnthropic
    redis_url: str  # the redis-server itself, not through the proxy


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LossStack]:
    tmp = Path(tmp_path_factory.mktemp("lost-replies"))
    port = free_port()
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp / "redis") as url,
        ReplyLoss(int(url.rsplit(":", 1)[1])) as proxy,
    ):
        env = stack_env(proxy.url + "/0", model.url, SIFT_WORKER_METRICS_PORT=str(port))
        with (
            gateway(tmp / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp / "w", env, "w"),
        ):
            ingest(client)
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            yield LossStack(client, proxy, metrics_url, model, url + "/0")


def completed(url: str) -> dict[tuple[str, str], float]:
    """``sift_jobs_completed_total`` by (kind, status), as ``url`` serves it now."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        if family.name == "sift_jobs_completed":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["kind"], sample.labels["status"])
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def increase(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def the_webhook(receiver: Receiver, job_id: str) -> list[str]:
    """The statuses of the job's webhooks, once one has come (and a second had time to)."""
    wait_for(lambda: bool(receiver.for_job(job_id)), f"the webhook of {job_id}", 60)
    time.sleep(1.0)
    return [d.body["data"]["status"] for d in receiver.for_job(job_id)]


def billed_and_counted(stack: LossStack) -> tuple[dict[str, int], dict[str, float]]:
    """What the model has billed (input and output tokens) and what the worker counted."""
    billed = stack.model.usage()
    counted = {"input_tokens": 0.0, "output_tokens": 0.0}
    for family in text_string_to_metric_families(httpx.get(stack.worker_metrics, timeout=10).text):
        if family.name == "sift_rerank_tokens":
            for sample in family.samples:
                kind = {"input": "input_tokens", "output": "output_tokens"}.get(
                    sample.labels["type"]
                )
                if sample.name.endswith("_total") and kind is not None:
                    counted[kind] += sample.value
    return {k: billed[k] for k in counted}, counted


def assert_usage_once(
    stack: LossStack, before: tuple[dict[str, int], dict[str, float]], shown: dict[str, Any]
) -> None:
    """The job's usage is what the model billed since ``before``, and the worker counted it
    once: a finish sent again adds nothing to the tokens, the record or a batch's totals."""
    billed, counted = billed_and_counted(stack)
    for key in counted:
        spent = billed[key] - before[0][key]
        assert spent > 0 and shown[key] == spent == counted[key] - before[1][key], key


def counters(stack: LossStack) -> dict[tuple[str, str], float]:
    """The worker's and the gateway's counters, summed."""
    both = completed(stack.worker_metrics)
    for key, value in completed(str(stack.client.base_url) + "/metrics").items():
        both[key] = both.get(key, 0.0) + value
    return both


@pytest.mark.timeout(180)
def test_a_search_whose_finish_reply_was_lost_still_sends_its_webhook_and_counts_once(
    stack: LossStack, receiver: Receiver
) -> None:
    before = counters(stack)
    used = billed_and_counted(stack)
    stack.proxy.arm(*FINISHED, SEARCH_KEY.encode())
    response = stack.client.post(
        "/v1/searches",
        json={"index": INDEX, "query": sample_queries()[0], "webhook_url": receiver.url},
        headers=ACME,
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert stack.proxy.fired.wait(60), "the finish's reply was never lost"
    wait_for(
        lambda: (
            stack.client.get(f"/v1/searches/{job_id}", headers=ACME).json()["status"] == "succeeded"
        ),
        "the search succeeded",
    )
    assert the_webhook(receiver, job_id) == ["succeeded"]
    assert stack.proxy.sent_again == 1, stack.proxy.sent_again  # the finish sent again
    assert increase(before, counters(stack)) == {("search", "succeeded"): 1.0}
    job = stack.client.get(f"/v1/searches/{job_id}", headers=ACME).json()
    assert_usage_once(stack, used, job["result"]["usage"])


@pytest.mark.timeout(180)
def test_a_batch_whose_last_finish_reply_was_lost_completes_once_with_its_webhook(
    stack: LossStack, receiver: Receiver
) -> None:
    before = counters(stack)
    used = billed_and_counted(stack)
    stack.proxy.arm(*FINISHED, BATCH_ITEMS_KEY.encode())
    batch_id = submit_batch(stack.client, 1, webhook_url=receiver.url)
    assert stack.proxy.fired.wait(60), "the finish's reply was never lost"
    wait_for(
        lambda: batch_counts(stack.client, batch_id)["finished_at"] is not None, "batch finished"
    )
    batch = batch_counts(stack.client, batch_id)
    assert batch["status"] == "succeeded" and batch["counts"]["succeeded"] == 1, batch
    assert the_webhook(receiver, batch_id) == ["succeeded"]
    # the finish was sent again (the second run answered as the first), not given up
    assert stack.proxy.sent_again == 1, stack.proxy.sent_again
    assert increase(before, counters(stack)) == {
        ("batch_item", "succeeded"): 1.0,
        ("batch", "succeeded"): 1.0,
    }
    # and its outcome is in the batch's totals once
    batch = batch_counts(stack.client, batch_id)
    assert sum(batch["rerank_outcomes"].values()) == 1, batch
    # and its usage too: the batch's totals, as the model billed and the worker counted
    assert_usage_once(stack, used, batch["usage"])


@pytest.mark.timeout(300)
def test_a_cancel_whose_reply_was_lost_answers_and_counts_what_it_canceled(
    stack: LossStack, receiver: Receiver
) -> None:
    total = 600
    stack.model.reset()
    before = counters(stack)
    stack.proxy.arm(CANCEL_SCRIPT)
    batch_id = submit_batch(stack.client, total, webhook_url=receiver.url)
    response = stack.client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert stack.proxy.fired.is_set(), "the cancel's reply was never lost"
    assert response.status_code == 200, response.text
    wait_for(
        lambda: batch_counts(stack.client, batch_id)["finished_at"] is not None, "batch finished"
    )
    batch: dict[str, Any] = batch_counts(stack.client, batch_id)
    counts = batch["counts"]
    assert counts["canceled"] > 0 and batch["status"] == "canceled", batch
    assert sum(counts[s] for s in ("succeeded", "failed", "canceled")) == total, counts
    assert the_webhook(receiver, batch_id) == ["canceled"]
    moved = increase(before, counters(stack))
    assert moved == {
        **{
            ("batch_item", s): float(counts[s])
            for s in ("succeeded", "failed", "canceled")
            if counts[s]
        },
        ("batch", "canceled"): 1.0,
    }, (moved, counts)


@pytest.mark.timeout(300)
def test_a_redis_restart_as_a_webhook_is_enqueued_delays_it_only_by_the_restart(
    stack: LossStack, receiver: Receiver
) -> None:
    """Redis goes down for 2 s (as ``test_broker_restart.py`` restarts it) just as the
    worker enqueues a finished search's webhook. The job store rides the restart out; the
    webhook's enqueue must too, or it was lost with the task's failure (its message acked,
    or left unacked until the visibility timeout brought it back, 27 minutes later)."""
    stack.proxy.arm(b"LPUSH", WEBHOOK_QUEUE.encode(), outage=2.0)
    response = stack.client.post(
        "/v1/searches",
        json={"index": INDEX, "query": sample_queries()[2], "webhook_url": receiver.url},
        headers=ACME,
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert stack.proxy.fired.wait(60), "Redis never went down at the enqueue"
    assert the_webhook(receiver, job_id) == ["succeeded"]
    status = stack.client.get(f"/v1/searches/{job_id}", headers=ACME).json()["status"]
    assert status == "succeeded"


@pytest.mark.timeout(120)
def test_every_publisher_of_a_worker_rides_out_a_redis_restart(tmp_path: Path) -> None:
    """redis-server SIGKILLed and started again 8 s later (a restart longer than the 2 s
    above) while three threads publish at once through the worker's Celery settings: each
    publish waits for Redis and gets through. One producer had published before the
    restart; the pool makes the other two during it, and a new producer's connect gave up
    after kombu's 4 s connect timeout (``task_publish_retry_policy`` covers a connection
    that broke, not one being made): the task failed and its webhook was lost."""
    with broker(tmp_path / "redis") as server:
        app = Celery("publishers", set_as_current=False)
        app.conf.update(celery_config(load_settings(redis_url=server.url + "/0")))
        app.send_task(WEBHOOK_TASK, args=[{"n": 0}], queue=WEBHOOK_QUEUE)  # a warm producer
        with redis.Redis.from_url(server.url) as client:  # its message in the AOF before the
            server.written(client)  # kill: everysec lost it once (CI: 3 queued, no failure)
        server.kill(signal.SIGKILL)
        failures: list[BaseException] = []

        def publish(n: int) -> None:
            try:
                app.send_task(WEBHOOK_TASK, args=[{"n": n}], queue=WEBHOOK_QUEUE)
            except Exception as exc:
                failures.append(exc)

        threads = [threading.Thread(target=publish, args=(n,)) for n in range(1, 4)]
        for thread in threads:
            thread.start()
        time.sleep(8.0)  # Redis is down this long
        server.start_again()
        for thread in threads:
            thread.join(60)
        client = redis.Redis.from_url(server.url)
        try:
            queued = client.llen(WEBHOOK_QUEUE)
        finally:
            client.close()
        app.close()
    assert failures == [] and queued == 4, (failures, queued)


@pytest.mark.timeout(300)
def test_a_cancel_whose_reply_is_lost_while_redis_stays_down_is_not_reported_as_not_taken(
    stack: LossStack,
) -> None:
    """The cancel runs, its reply is lost, and Redis stays down 8 s: past the 5 s the gateway
    retries a cancel for. The answer must say the outcome is unknown (a ``503`` naming it,
    not a bare "retry"), and the cancel sent again, once Redis is back and the batch has
    ended ``canceled`` by the first one, must say it took effect: it answered ``409
    already_finished``, "nothing was canceled", for a batch that reads ``canceled``."""
    total = 200
    stack.proxy.arm(CANCEL_SCRIPT, down_after=8.0)
    batch_id = submit_batch(stack.client, total)
    response = stack.client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert stack.proxy.fired.is_set(), "the cancel's reply was never lost"
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "unavailable" and error["field"] == "id", error
    assert "unknown" in error["message"] and "cancel" in error["message"], error
    assert response.headers["retry-after"] == "1"
    wait_for(
        lambda: batch_counts(stack.client, batch_id)["finished_at"] is not None, "batch finished"
    )
    batch = batch_counts(stack.client, batch_id)
    assert batch["status"] == "canceled" and batch["counts"]["canceled"] > 0, batch
    again = stack.client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert again.status_code == 200, again.text
    assert again.json() == batch


@pytest.mark.timeout(300)
def test_a_keyed_search_answered_503_with_redis_down_frees_its_key_once_redis_is_back(
    stack: LossStack,
) -> None:
    """Redis goes down for 8 s as a keyed search is created: the create never runs, the
    request is answered ``503``, and its release of the key's claim meets Redis down too.
    Nothing was made, so the key must be freed once Redis answers (its marker deleted), not
    left to say ``409 idempotency_key_in_progress`` ("the first request ... has not created
    its job yet") to each resend until the marker expires 120 s after the claim: a client
    resending as the ``503`` and the ``409`` tell it to got 409s for those two minutes, for a
    request that had ended. Watched on the redis-server itself (keyspace events), so the
    outage, played by the proxy, does not break the watch."""
    key, body = "resent-after-a-503", {"index": INDEX, "query": "who beat Kasparov"}
    marker = _idem_key("acme", key)
    direct = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    direct.config_set("notify-keyspace-events", "Kgx")  # DEL and expiry events of keys
    watch = direct.pubsub()
    watch.subscribe(f"__keyspace@0__:{marker}")
    try:
        stack.proxy.arm(CREATE_SEARCH_SCRIPT, outage=8.0)
        headers = {**ACME, "Idempotency-Key": key}
        response = stack.client.post("/v1/searches", json=body, headers=headers)
        assert stack.proxy.fired.is_set(), "Redis never went down at the create"
        assert response.status_code == 503, response.text
        assert direct.get(marker) is not None, "the claim was released while Redis was down"
        events: list[str] = []
        deadline = time.monotonic() + IDEMPOTENCY_PENDING_TTL_SECONDS + 30
        while not events and time.monotonic() < deadline:
            message = watch.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None and message["data"] in ("del", "expired"):
                events.append(message["data"])  # not the claim's own set and expire
        assert events == ["del"], f"the claim's marker was not released but {events or 'kept'}"
        again = stack.client.post("/v1/searches", json=body, headers=headers)
        assert again.status_code == 202, again.text
        assert "idempotent-replayed" not in again.headers, again.headers
    finally:
        watch.close()
        direct.config_set("notify-keyspace-events", "")
        direct.close()


@pytest.mark.timeout(300)
def test_a_cancel_count_take_whose_reply_is_lost_while_redis_stays_down_is_counted_once(
    stack: LossStack,
) -> None:
    """The gateway hears the cancel; its take of the cancel's count runs, its reply is lost,
    and Redis stays down 8 s, past the take's 5 s of retries. What the take took is in no
    record any more (the cancel's count message then finds nothing), so the gateway sends
    the take again with its token once Redis is back: every item and the batch are counted
    once. Before, the gateway gave up and they were never counted."""
    total = 600  # the count message waits behind the batch's chunks: the gateway takes first
    before = counters(stack)
    stack.proxy.arm(TAKE_SCRIPT, down_after=8.0)
    batch_id = submit_batch(stack.client, total)
    response = stack.client.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert stack.proxy.fired.is_set(), "the take's reply was never lost"
    assert response.status_code == 200, response.text
    wait_for(
        lambda: batch_counts(stack.client, batch_id)["finished_at"] is not None, "batch finished"
    )
    counts = batch_counts(stack.client, batch_id)["counts"]
    assert counts["canceled"] > 0, counts
    expected = {
        **{
            ("batch_item", s): float(counts[s])
            for s in ("succeeded", "failed", "canceled")
            if counts[s]
        },
        ("batch", "canceled"): 1.0,
    }
    wait_for(lambda: increase(before, counters(stack)) == expected, "counted", 60)
    time.sleep(2.0)  # and not counted twice
    assert increase(before, counters(stack)) == expected


def _cancels_counted(base_url: str) -> float:
    """The gateway's ``sift_http_requests_total`` of ``DELETE /v1/batches/{id}``."""
    families = text_string_to_metric_families(http_get(base_url + "/metrics", timeout=10).text)
    return sum(
        sample.value
        for family in families
        if family.name == "sift_http_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
        and sample.labels["method"] == "DELETE"
        and sample.labels["route"] == "/v1/batches/{id}"
    )


@pytest.mark.timeout(300)
def test_a_take_sent_again_holds_neither_the_cancel_s_request_nor_the_gateway_s_stop(
    tmp_path: Path,
) -> None:
    """The gateway's take of a heard cancel's count runs, its reply is lost, and Redis stays
    down (120 s here): the take is sent again in the gateway's background, and that must
    hold neither the cancel's request (answered, it is counted and timed in
    sift_http_requests_total and sift_http_request_duration_seconds at once) nor the
    gateway's stop (SIGTERM: it exits, the take given up, as a gateway dying does). Before,
    the take ran as the request's background task: the request was counted and timed only
    once the take was answered, and uvicorn, on SIGTERM, waited for it before exiting."""
    with (
        redis_server(tmp_path / "redis") as url,
        ReplyLoss(int(url.rsplit(":", 1)[1])) as proxy,
    ):
        env = child_env(stack_env(proxy.url + "/0", "http://127.0.0.1:9"), inherit_sift=False)
        service, base = gateway_service(tmp_path / "g", env)
        with running(service), httpx.Client(base_url=base, timeout=30) as client:
            batch_id = submit_batch(client, 3)
            proxy.arm(TAKE_SCRIPT, down_after=120.0)
            response = client.delete(f"/v1/batches/{batch_id}", headers=ACME)
            assert proxy.fired.is_set(), "the take's reply was never lost"
            assert response.status_code == 200, response.text
            wait_for(lambda: _cancels_counted(base) == 1.0, "the cancel's request counted", 20)
            assert service.proc is not None
            service.proc.send_signal(signal.SIGTERM)
            try:
                code = service.proc.wait(30)
            except subprocess.TimeoutExpired:
                code = None
            assert code is not None, "the gateway did not exit on SIGTERM while Redis was down"
