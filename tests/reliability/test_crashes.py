"""A gateway restarted mid-batch loses nothing. The test runs a real stack of its own
(redis-server, gateway, a threads-pool worker, the fake model over HTTP) at the default
reliability settings, and checks the batch through the API and the job store: every item
``succeeded``, each query id has exactly one result, and the counts moved exactly once per
item.

A worker SIGKILLed mid-batch (its deliveries back through the dead-worker check, the
``batch.completed`` webhook under one ``webhook-id``) is ``test_worker_recovery.py``'s, at
every default; Redis restarts (SIGKILL and SIGTERM, AOF ``everysec``, at the defaults) are
``test_broker_restart.py``'s; the gateway's reconnect, ``test_gateway_reconnect.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    INDEX,
    assert_batch_exactly_once,
    batch_counts,
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


def _succeeded(client: httpx.Client, batch_id: str) -> int:
    return int(batch_counts(client, batch_id)["counts"]["succeeded"])


def _finished(client: httpx.Client, batch_id: str) -> bool:
    return batch_counts(client, batch_id)["status"] == "succeeded"


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
