"""The economy lane under the provider's processing-queue cap, through a real stack.

A real Celery worker and gateway on a real redis-server, the SDK pointed at the fake Messages
API, whose provider batches stay ``in_progress`` for a second. ``SIFT_RATE_LIMITS`` caps the
economy lane's processing queue at 4 requests and provider batches hold 4: three provider
batches can only go one after the other, each once the previous one ended, and every item
still comes back reranked.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ACME, ANTHROPIC_API_KEY, INDEX, KEYS, SAMPLE
from tests.fake_anthropic import FakeAnthropic
from tests.services import celery_worker, gateway, redis_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "claude-haiku-4-5"
PROCESSING_SECONDS = 1.0


@pytest.fixture(scope="module")
def capped(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[httpx.Client, FakeAnthropic]]:
    tmp = Path(tmp_path_factory.mktemp("economy-limits"))
    with redis_server(tmp / "redis") as redis_url, FakeAnthropic() as model:
        env = {
            "SIFT_API_KEYS": json.dumps(KEYS),
            "SIFT_DATA_DIR": str(tmp / "data"),
            "SIFT_REDIS_URL": redis_url + "/0",
            "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
            "ANTHROPIC_BASE_URL": model.url,
            "ANTHROPIC_API_KEY": ANTHROPIC_API_KEY,
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_ECONOMY_POLL_SECONDS": "0.2",
            "SIFT_ECONOMY_POLL_MAX_SECONDS": "0.5",
            "SIFT_ECONOMY_MAX_REQUESTS_PER_BATCH": "4",
            "SIFT_RATE_LIMITS": json.dumps({MODEL: {"economy": {"rpm": 600, "queued": 4}}}),
        }
        with (
            celery_worker(tmp / "w", env, "w1", concurrency=16),
            gateway(tmp / "g", env, "live") as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            lines = (SAMPLE / "sample_corpus.jsonl").read_text().splitlines()
            docs = [json.loads(line) for line in lines if line.strip()]
            response = client.post(
                f"/v1/indexes/{INDEX}/documents",
                params={"wait": 30},
                json={"documents": [{"id": d["id"], "text": d["text"]} for d in docs]},
                headers=ACME,
            )
            assert response.json()["status"] == "succeeded", response.text
            model.configure(batch_processing_seconds=PROCESSING_SECONDS)
            yield client, model


def _wait(client: httpx.Client, batch_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
        if batch["finished_at"]:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def test_provider_batches_wait_for_room_in_the_processing_queue(
    capped: tuple[httpx.Client, FakeAnthropic],
) -> None:
    client, model = capped
    items = [{"id": f"q{i}", "query": f"volcano eruption {i}", "limit": 5} for i in range(12)]
    body = {"index": INDEX, "queries": items, "rerank": True, "lane": "economy"}
    response = client.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    batch = _wait(client, response.json()["id"])
    assert batch["counts"]["succeeded"] == 12, batch
    created = sorted(b.created_at for b in model._state.batches.values())
    assert len(created) == 3
    # each provider batch was created only once the one before had ended (1 s in progress):
    # never more than the cap's 4 requests in the provider's processing queue
    gaps = [later - earlier for earlier, later in itertools.pairwise(created)]
    assert all(gap >= PROCESSING_SECONDS for gap in gaps), gaps
    page = client.get(
        f"/v1/batches/{batch['id']}/results", params={"page_size": 100}, headers=ACME
    ).json()
    assert all(r["result"]["rerank"]["applied"] for r in page["results"]), page
