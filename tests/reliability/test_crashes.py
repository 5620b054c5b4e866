"""Crashes mid-batch lose nothing: a worker SIGKILLed, the gateway restarted. Each test runs a
real stack of its own (redis-server, gateway, threads-pool workers, the fake model over HTTP)
at the default reliability settings, and checks the batch through the API and the job
store: every item ``succeeded``, each query id has exactly one result, and the counts moved
exactly once per item.

A killed worker's unacked messages would go back to their queue only after the broker's
visibility timeout (about 27 minutes by default). The surviving worker's dead-worker check
(:mod:`worker.queue.liveness`) sees the killed worker's heartbeat gone and puts its
deliveries back within seconds, and the job store's compare-and-set keeps each item to one
result. A chunk message lost in kombu's pop-then-unacked window comes back through the re-
drive (:mod:`worker.queue.redrive`), at its defaults (a batch idle for 2 minutes, swept
every 30 s); the test prints the re-drives it logged (usually none: the window is
milliseconds wide).

Redis restarts (SIGKILL and SIGTERM, AOF ``everysec``, at the defaults) are
``test_broker_restart.py``'s; the gateway's reconnect, ``test_gateway_reconnect.py``'s.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

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
# smaller chunks and fewer item threads than the defaults, so 1,000 items take a while; the
# recovery itself (visibility timeout, heartbeat, delivery cap, re-drive) at its defaults
BATCH_SHAPE = {"SIFT_BATCH_CHUNK_SIZE": "10", "SIFT_BATCH_ITEM_CONCURRENCY": "32"}
# the worst case at the defaults: a chunk lost in kombu's pop-then-unacked window, back after
# the re-drive's stall (120 s) and two sweeps (30 s each), plus the batch's own work
RECOVERY_WINDOW_SECONDS = 300.0


def _succeeded(client: httpx.Client, batch_id: str) -> int:
    return int(batch_counts(client, batch_id)["counts"]["succeeded"])


def _finished(client: httpx.Client, batch_id: str) -> bool:
    return batch_counts(client, batch_id)["status"] == "succeeded"


@pytest.mark.timeout(600)
def test_a_worker_killed_mid_batch_loses_nothing(
    tmp_path: Path, model: FakeAnthropic, receiver: Receiver
) -> None:
    """SIGKILL worker A while a 1,000-item batch runs; worker B finishes it. Every item
    succeeds once, and the batch webhook arrives with the same ``webhook-id`` every time."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, **BATCH_SHAPE)
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
                    wait_for(
                        lambda: _finished(client, batch_id),
                        "the batch finished on B",
                        RECOVERY_WINDOW_SECONDS,
                    )
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


@pytest.mark.timeout(300)
def test_a_gateway_restarted_mid_batch_leaves_jobs_in_flight_unaffected(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """Stop the gateway (SIGTERM) while a batch and single searches run; a new gateway on
    the same port serves their results, all succeeded, each exactly once."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, **BATCH_SHAPE)
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
