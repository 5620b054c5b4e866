"""A running search's message put back by a broker reconnect, on the real stack (redis-server,
a real Celery worker at the defaults, the gateway): the copy is no delivery.

The worker's broker connections are killed (CLIENT KILL; Redis stays up) while the search's
query is being embedded: kombu's close puts the running task's message back, and the worker
takes it again while the first run goes on. The copy is refused by the search's run claim
before its delivery is counted: the message's counter stays at 1. Before, the copy counted a
second delivery, a lost worker's that never was: the copies (kombu's restores, each taken
while the last was in flight) past ``SIFT_TASK_MAX_DELIVERIES`` failed the search
``delivery_limit_exceeded`` under its live run, and fewer real worker losses than the limit
made the message poison after a copy (``tests/integration/test_tasks.py`` plays the limit).
A second kill after the copy was acked restores nothing: the run holds no unacked message
any more, so one reconnect gives one copy here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.support import ACME, submit_search, wait_for
from tests.reliability.test_ingest_crashes import KEPT, final, own_crash_stack, upsert, worker
from tests.services import free_port
from worker.constants import ATTEMPTS_KEY, KOMBU_UNACKED_KEY, SEARCH_QUEUE

pytestmark = pytest.mark.integration


def search(client: httpx.Client, job_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/searches/{job_id}", headers=ACME)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def searches_completed(port: int) -> dict[str, float]:
    """``sift_jobs_completed_total{kind="search"}`` by status (those above 0)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples if family.name == "sift_jobs_completed" else []:
            if sample.name.endswith("_total") and sample.labels["kind"] == "search":
                out[sample.labels["status"]] = sample.value
    return {status: n for status, n in out.items() if n}


@pytest.mark.timeout(300)
def test_a_running_search_s_copy_put_back_by_a_reconnect_counts_no_delivery(
    tmp_path: Path,
) -> None:
    with (
        own_crash_stack(tmp_path) as crash,
        redis.Redis.from_url(crash.env["SIFT_REDIS_URL"]) as raw,
    ):
        port = free_port()
        with worker(crash, "a", port) as proc:
            assert final(crash.client, upsert(crash.client, KEPT))["status"] == "succeeded"
            job_id = submit_search(crash.client, "hold-embedding calcium and bone density")
            held = crash.directory / "crashes" / "hold-embedding"
            wait_for(held.exists, "the search's first run, held in its query's embedding")
            started = search(crash.client, job_id)
            assert started["status"] == "running", started
            log = crash.directory / "w" / "a.log"
            (task_id,) = re.findall(r"Task sift\.search\[([0-9a-f-]+)\] received", log.read_text())
            raw.client_kill_filter(_type="normal", skipme=True)  # the worker's too
            copy_done = f"Task sift.search[{task_id}] succeeded"  # refused, then acked
            wait_for(
                lambda: (
                    not raw.llen(SEARCH_QUEUE)
                    and not raw.hlen(KOMBU_UNACKED_KEY)  # the copy taken and acked
                    and (
                        copy_done in log.read_text()
                        or search(crash.client, job_id)["status"] != "running"
                    )
                ),
                "the copy delivered and done",
            )
            deliveries = raw.get(f"{ATTEMPTS_KEY}{task_id}:0")
            meanwhile = search(crash.client, job_id)
            (crash.directory / "crashes" / "release").touch()
            wait_for(lambda: search(crash.client, job_id)["status"] != "running", "its end")
            ended = search(crash.client, job_id)
            wait_for(
                lambda: not raw.llen(SEARCH_QUEUE) and not raw.hlen(KOMBU_UNACKED_KEY), "drained"
            )
            counted = searches_completed(port)
            assert proc.poll() is None  # the same worker, still running
    assert deliveries == b"1", deliveries  # the first run's only: the copy counted none
    assert meanwhile == started, (meanwhile, started)  # the copy wrote nothing
    assert ended["status"] == "succeeded", ended
    assert ended["started_at"] == started["started_at"], (ended, started)
    assert counted == {"succeeded": 1.0}, counted
