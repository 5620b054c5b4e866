"""Crashes mid-batch lose nothing: a worker SIGKILLed, Redis SIGKILLed (AOF on), the gateway
restarted. Each test runs a real stack of its own (redis-server, gateway, threads-pool
workers, the fake model over HTTP) and checks the batch through the API and the job store:
every item ``succeeded``, each query id has exactly one result, and the counts moved exactly
once per item.

The broker's visibility timeout. Celery acks late, so a message a worker took is kept in
kombu's "unacked" hash until the task ends. When the worker dies (SIGKILL: no warm shutdown,
nothing is requeued), those messages would go back to their queue only once older than the
transport's ``visibility_timeout`` (about 27 minutes by default). The worker-kill test runs
with that default: the surviving worker's dead-worker check (:mod:`worker.queue.liveness`) sees the
killed worker's heartbeat gone and puts its deliveries back within seconds, and the job
store's compare-and-set keeps each item to one result. The Redis test still sets
``SIFT_BROKER_VISIBILITY_TIMEOUT_SECONDS=6`` and ``SIFT_TASK_MAX_DELIVERIES=10``.

The re-drive. kombu takes a message with ``BRPOP`` and records it as unacked in a second
command, so a worker killed, or a Redis killed, between the two loses that one chunk
message: it is in no queue and not unacked, and the visibility timeout never brings it back.
The workers' re-drive (:mod:`worker.queue.redrive`) finds a batch idle with pending items that no
message covers and sends those chunks again; these tests run it every second on batches idle
for 3 s, and print the re-drives it logged (usually none: the window is milliseconds wide).

When Redis dies, Celery's worker process itself sometimes exits ("Unrecoverable error", a
kombu bug: celery/celery#10205). Deployments restart it (``restart: unless-stopped`` in
``deploy/docker-compose.yml``, a Deployment in ``deploy/k8s``); the Redis test runs its worker
under the same kind of supervisor, and checks that nothing the dead process held is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    INDEX,
    Receiver,
    assert_batch_exactly_once,
    batch_counts,
    broker_state,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker, free_port, gateway, redis_server

pytestmark = pytest.mark.integration

TOTAL = 1_000
# the worker-kill test: recovery itself at its defaults (visibility timeout, heartbeat,
# delivery cap); smaller chunks and fewer threads so 1,000 items take a while
KILL_SETTINGS = {
    "SIFT_BATCH_CHUNK_SIZE": "10",
    "SIFT_BATCH_ITEM_CONCURRENCY": "32",
    # the re-drive sweeps every second and acts on a batch idle for 3 s (in production 30 s
    # and 2 minutes): a chunk message lost in kombu's pop-then-unacked window comes back fast
    "SIFT_REDRIVE_INTERVAL_SECONDS": "1",
    "SIFT_REDRIVE_STALL_SECONDS": "3",
}
CRASH_SETTINGS = {
    **KILL_SETTINGS,
    "SIFT_BROKER_VISIBILITY_TIMEOUT_SECONDS": "6",
    "SIFT_TASK_MAX_DELIVERIES": "10",
}


def _succeeded(client: httpx.Client, batch_id: str) -> int:
    return int(batch_counts(client, batch_id)["counts"]["succeeded"])


def _finished(client: httpx.Client, batch_id: str) -> bool:
    return batch_counts(client, batch_id)["status"] == "succeeded"


@pytest.mark.timeout(300)
def test_a_worker_killed_mid_batch_loses_nothing(
    tmp_path: Path, model: FakeAnthropic, receiver: Receiver
) -> None:
    """SIGKILL worker A while a 1,000-item batch runs; worker B finishes it. Every item
    succeeds once, and the batch webhook arrives with the same ``webhook-id`` every time."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, **KILL_SETTINGS)
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            with celery_worker(tmp_path / "w", env, "a", concurrency=8) as worker_a:
                ingest(client)
                batch_id = submit_batch(client, TOTAL, webhook_url=receiver.url)
                wait_for(lambda: _succeeded(client, batch_id) >= 150, "150 items done on A")
                worker_a.send_signal(signal.SIGKILL)
                worker_a.wait(10)
                at_kill = batch_counts(client, batch_id)["counts"]
            print(f"\nworker A killed with counts {at_kill}")
            assert at_kill["succeeded"] < TOTAL, "the batch finished before the kill"
            with celery_worker(tmp_path / "w", env, "b", concurrency=8):
                try:
                    wait_for(lambda: _finished(client, batch_id), "the batch finished on B", 120)
                except AssertionError as exc:
                    counts = batch_counts(client, batch_id)["counts"]
                    raise AssertionError(f"{exc}; {counts}; {broker_state(url + '/0')}") from exc
                wait_for(lambda: bool(receiver.for_job(batch_id)), "the batch webhook", 30)
                time.sleep(1.0)  # a late duplicate, if any, lands now
            assert_batch_exactly_once(client, url + "/0", batch_id, TOTAL)
            deliveries = receiver.for_job(batch_id)
            assert {d.headers["webhook-id"] for d in deliveries} == {f"msg_{batch_id}"}
            assert {d.body["type"] for d in deliveries} == {"batch.completed"}
            print(f"batch webhook delivered {len(deliveries)} time(s)")
            print(f"re-drives: {_redrives(tmp_path / 'w') or 'none'}")


def _redrives(directory: Path) -> list[str]:
    """The re-drive's log lines in the workers' logs under ``directory``."""
    return [
        line
        for log in sorted(directory.glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "re-driven" in line
    ]


@contextlib.contextmanager
def supervised_worker(
    directory: Path, env: dict[str, str], name: str, concurrency: int
) -> Iterator[list[str]]:
    """A worker run the way ``deploy/`` runs it (compose ``restart: unless-stopped``, a k8s
    Deployment): when the process exits, another one starts. Yields the restarts' names.

    Celery can exit with "Unrecoverable error" when the broker dies under it (kombu closing a
    channel over a connection it already dropped: ``AttributeError`` on ``conninfo.hostname``,
    celery/celery#10205); a worker process is meant to be restarted by its supervisor then,
    and the messages and jobs it held must survive that, which is what the test checks.
    """
    restarts: list[str] = []
    stopping = threading.Event()
    with contextlib.ExitStack() as processes:
        current = processes.enter_context(
            celery_worker(directory, env, name, concurrency=concurrency)
        )

        def supervise() -> None:
            nonlocal current
            while not stopping.wait(0.5):
                if current.poll() is None:
                    continue
                again = f"{name}-restart{len(restarts) + 1}"
                restarts.append(again)
                with contextlib.suppress(Exception):  # Redis still down: try again
                    current = processes.enter_context(
                        celery_worker(directory, env, again, concurrency=concurrency)
                    )

        supervisor = threading.Thread(target=supervise, daemon=True)
        supervisor.start()
        try:
            yield restarts
        finally:
            stopping.set()
            supervisor.join(timeout=60)


def _kill_redis(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_redis_killed_mid_batch_with_aof_always_loses_nothing(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """SIGKILL redis-server mid-batch, then start it again on the same port and directory.

    ``appendfsync always``: every write Redis acknowledged is on disk before the reply, so
    not even a machine crash loses an acknowledged job or message; the test can then demand
    that nothing at all is lost. (After a mere process kill ``everysec`` would keep the data
    too, as the write(2) precedes the reply; only its fsync waits up to a second.) The gateway
    and the workers reconnect on their own."""
    directory, port = tmp_path / "redis", free_port()
    first = redis_server(directory, port=port, appendonly=True, appendfsync="always")
    url = first.__enter__()
    try:
        env = stack_env(url + "/0", model.url, **CRASH_SETTINGS)
        with (
            supervised_worker(tmp_path / "w", env, "w1", concurrency=8) as restarts,
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            batch_id = submit_batch(client, TOTAL)
            wait_for(lambda: _succeeded(client, batch_id) >= 150, "150 items done")
            _kill_redis(url)
            first.__exit__(None, None, None)
            time.sleep(2.0)  # the clients see the broker and the store gone
            down = client.get(f"/v1/batches/{batch_id}", headers=ACME)
            assert down.status_code == 503, down.text  # typed, not a 500
            with redis_server(directory, port=port, appendonly=True, appendfsync="always"):
                try:
                    wait_for(lambda: _finished(client, batch_id), "the batch finished", 60)
                except AssertionError as exc:
                    counts = batch_counts(client, batch_id)["counts"]
                    raise AssertionError(f"{exc}; {counts}; {broker_state(url + '/0')}") from exc
                assert_batch_exactly_once(client, url + "/0", batch_id, TOTAL)
                # and the stack still takes new work
                fresh = client.post(
                    "/v1/searches",
                    params={"wait": 20},
                    json={"index": INDEX, "query": "volcano"},
                    headers=ACME,
                )
                assert fresh.status_code == 200 and fresh.json()["status"] == "succeeded"
                print(f"\nre-drives: {_redrives(tmp_path / 'w') or 'none'}; restarts: {restarts}")
    finally:
        with contextlib.suppress(Exception):
            first.__exit__(None, None, None)


@pytest.mark.timeout(300)
def test_a_gateway_restarted_mid_batch_leaves_jobs_in_flight_unaffected(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """Stop the gateway (SIGTERM) while a batch and single searches run; a new gateway on
    the same port serves their results, all succeeded, each exactly once."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, **CRASH_SETTINGS)
        port = free_port()
        with celery_worker(tmp_path / "w", env, "w1", concurrency=8):
            with (
                gateway(tmp_path / "g", env, "g1", port=port) as base,
                httpx.Client(base_url=base, timeout=30) as client,
            ):
                ingest(client)
                batch_id = submit_batch(client, TOTAL)
                searches = [
                    client.post(
                        "/v1/searches", json={"index": INDEX, "query": f"tea {i}"}, headers=ACME
                    ).json()["id"]
                    for i in range(20)
                ]
                wait_for(lambda: _succeeded(client, batch_id) >= 100, "100 items done")
            # the first gateway is stopped here; the batch goes on without it
            with (
                gateway(tmp_path / "g", env, "g2", port=port) as again,
                httpx.Client(base_url=again, timeout=30) as client,
            ):
                assert again == base
                wait_for(lambda: _finished(client, batch_id), "the batch finished", 120)
                assert_batch_exactly_once(client, url + "/0", batch_id, TOTAL)
                for job_id in searches:
                    wait_for(
                        lambda job_id=job_id: (
                            client.get(f"/v1/searches/{job_id}", headers=ACME).json()["status"]
                            == "succeeded"
                        ),
                        f"search {job_id}",
                    )
