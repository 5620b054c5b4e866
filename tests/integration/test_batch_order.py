"""Batches run in the order they were submitted, even when a worker hands a chunk back.

Real redis-server, gateway, fake Messages API and ``sift worker`` processes. Worker 1 (two
threads, two items at once, chunks of 5) takes batch A's first chunks and starts two items;
batch B (one chunk) is submitted behind A's remaining chunks; worker 1 gets SIGTERM and
hands back the chunks whose items it had not started (``Reject(requeue=True)``: kombu's
reject, the path an intake pause's in-flight read takes too). Worker 2 (one thread, one item
at once: it runs the chunks one by one in the order it takes them) runs the rest. Every item
of A must reach the model before any item of B. kombu's own transport put the handed-back
chunks behind B's (``LPUSH`` onto a queue taken with ``BRPOP``), so B ran before them.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, INDEX, ingest, sample_queries, stack_env, wait_for
from tests.services import gateway, redis_server
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

ITEM = re.compile(r"item ([ab]\d{3})")


def submit(client: httpx.Client, prefix: str, n: int) -> str:
    """A batch whose every query names its item (``a000``...), so the model's requests say
    which item each is for."""
    queries = sample_queries()
    body: dict[str, Any] = {
        "index": INDEX,
        "rerank": True,
        "queries": [
            {"id": f"{prefix}{i:03d}", "query": f"{queries[i % len(queries)]} item {prefix}{i:03d}"}
            for i in range(n)
        ],
    }
    response = client.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def first_calls(model: FakeAnthropic) -> list[str]:
    """The items in the order they first reached the model."""
    seen: list[str] = []
    for request in model.requests():
        for item in ITEM.findall(str(request["body"].get("messages", ""))):
            if item not in seen:
                seen.append(item)
    return seen


def status(client: httpx.Client, batch_id: str) -> str:
    response = client.get(f"/v1/batches/{batch_id}", headers=ACME)
    response.raise_for_status()
    return str(response.json()["status"])


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    with FakeAnthropic(delay=2.0) as fake:  # worker 1's items are still running at its SIGTERM
        yield fake


@pytest.mark.timeout(300)
def test_a_handed_back_chunk_runs_before_a_later_batch(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    with redis_server(tmp_path / "redis") as base_url:
        env = stack_env(base_url + "/0", model.url, SIFT_BATCH_CHUNK_SIZE="5")
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # the default window: running items finish
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            one = child_env({**env, "SIFT_BATCH_ITEM_CONCURRENCY": "2"}, inherit_sift=False)
            with worker_process(tmp_path / "w1", one, "w1", concurrency=2) as first:
                ingest(client)
                a = submit(client, "a", 20)  # 4 chunks
                wait_for(lambda: len(model.requests()) >= 1, "worker 1 running A's items")
                b = submit(client, "b", 5)  # 1 chunk, behind A's
                first.send_signal(signal.SIGTERM)
                first.wait(60)
            handed_back = (tmp_path / "w1").glob("*.log")
            assert any("items handed back" in p.read_text() for p in handed_back)
            model.configure(delay=0.0)
            two = child_env({**env, "SIFT_BATCH_ITEM_CONCURRENCY": "1"}, inherit_sift=False)
            with worker_process(tmp_path / "w2", two, "w2", concurrency=1):
                wait_for(lambda: status(client, b) == "succeeded", "batch B finished", 120)
                wait_for(lambda: status(client, a) == "succeeded", "batch A finished", 120)
    order = first_calls(model)
    assert sorted(order) == [f"a{i:03d}" for i in range(20)] + [f"b{i:03d}" for i in range(5)]
    first_b = min(order.index(f"b{i:03d}") for i in range(5))
    late = [item for item in order[first_b:] if item.startswith("a")]
    assert not late, f"items of batch A that reached the model after B's first: {late}"
