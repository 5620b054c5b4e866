"""A tenant removed (its keys gone from ``SIFT_API_KEYS``) while its work waits in the queue:
the workers restarted without its keys run none of it and bill none of it.

Before, a rerank batch the tenant queued before its removal ran after the restart, one model
call per item for a tenant that no longer existed, and its search, ingest and delete ran too
(embedding its documents into an index nobody could read). Now each job of a tenant the
worker has no key for ends ``failed`` with ``tenant_removed`` where it would have started,
with no retrieval, no embedding and no model call; the counts, ``sift:stats:jobs`` and the
worker's counters say so; and its webhook, which nothing can sign, reads ``failed`` after 0
attempts. Another tenant's work, queued beside it, runs as before.

Everything is real: redis-server, ``sift worker`` processes, the gateway, the fake Messages
API on loopback HTTP, an HTTP webhook receiver.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.keys import ACME, ACME_KEY, GLOBEX, GLOBEX_KEY
from tests.reliability.support import INDEX, all_results, ingest, stack_env, wait_for
from tests.services import celery_worker, free_port, gateway, redis_server, webhook_inbox
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import METRIC_JOB_FAILURES, STATS_KEY, WEBHOOK_QUEUE, kombu_queue_keys

pytestmark = pytest.mark.integration

BOTH = [ACME_KEY, GLOBEX_KEY]


def _final(client: httpx.Client, path: str, headers: dict[str, str]) -> dict[str, Any]:
    """The job at ``path`` once it is final (a batch: once it has finished)."""
    body: dict[str, Any] = {}

    def done() -> bool:
        nonlocal body
        body = client.get(path, headers=headers).json()
        return bool(body.get("finished_at")) or body.get("status") in ("failed", "succeeded")

    wait_for(done, path)
    return body


def _failures(metrics_url: str) -> dict[tuple[str, str], float]:
    """The worker's ``sift_job_failures_total`` by (kind, error)."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name == METRIC_JOB_FAILURES:
                out[(sample.labels["kind"], sample.labels["error"])] = sample.value
    return out


def test_a_removed_tenants_queued_work_is_not_run_nor_billed(tmp_path: Path) -> None:
    with (
        redis_server(tmp_path / "redis") as base_url,
        FakeAnthropic() as model,
        webhook_inbox() as (hook, inbox),
    ):
        url = base_url + "/0"
        env = stack_env(url, model.url, SIFT_API_KEYS=json.dumps(BOTH))
        with (
            gateway(tmp_path / "g", env, "g1") as gateway_url,
            httpx.Client(base_url=gateway_url, timeout=30) as client,
        ):
            with celery_worker(tmp_path / "w", env, "w1", concurrency=8):
                ingest(client)  # acme's index
                ingest(client, GLOBEX)  # globex's, of the same name
            # the workers are stopped: both tenants queue work
            search = client.post(
                "/v1/searches", json={"index": INDEX, "query": "bees", "webhook_url": hook},
                headers=ACME,
            ).json()["id"]  # fmt: skip
            queries = [{"id": f"q{i}", "query": "bees"} for i in range(4)]
            batch = client.post(
                "/v1/batches", json={"index": INDEX, "queries": queries, "webhook_url": hook},
                headers=ACME,
            ).json()["id"]  # fmt: skip
            economy = client.post(
                "/v1/batches", json={"index": INDEX, "queries": queries, "lane": "economy"},
                headers=ACME,
            ).json()["id"]  # fmt: skip
            upsert = client.post(
                f"/v1/indexes/{INDEX}/documents",
                json={"documents": [{"id": "late", "text": "written after the removal"}]},
                headers=ACME,
            ).json()["id"]
            delete = client.delete(f"/v1/indexes/{INDEX}/documents/late", headers=ACME).json()["id"]
            kept = client.post(
                "/v1/searches", json={"index": INDEX, "query": "bees"}, headers=GLOBEX
            ).json()["id"]
            calls_before = len(model.requests())

            # the operator removes acme: the workers restart with globex's key alone
            metrics_port = free_port()
            removed = {
                **env,
                "SIFT_API_KEYS": json.dumps([GLOBEX_KEY]),
                "SIFT_WORKER_METRICS_PORT": str(metrics_port),
            }
            with celery_worker(tmp_path / "w", removed, "w2", concurrency=8):
                assert _final(client, f"/v1/searches/{kept}", GLOBEX)["status"] == "succeeded"
                found = _final(client, f"/v1/searches/{search}", ACME)
                ran = _final(client, f"/v1/batches/{batch}", ACME)
                eco = _final(client, f"/v1/batches/{economy}", ACME)
                upserted = _final(client, f"/v1/ingestions/{upsert}", ACME)
                deleted = _final(client, f"/v1/ingestions/{delete}", ACME)
                wait_for(
                    lambda: (
                        client.get(f"/v1/searches/{search}", headers=ACME).json()["webhook"]
                        != {"status": "pending", "attempts": 0}
                    ),
                    "the search's webhook settled",
                )
                wait_for(
                    lambda: (
                        client.get(f"/v1/batches/{batch}", headers=ACME).json()["webhook"]
                        != {"status": "pending", "attempts": 0}
                    ),
                    "the batch's webhook settled",
                )
                failures = _failures(f"http://127.0.0.1:{metrics_port}/metrics")
                # the gateway still takes acme's key, the worker answers no read of its index
                refused = client.get(f"/v1/indexes/{INDEX}/documents/late", headers=ACME)
                assert refused.status_code == 503, refused.text
                assert "'acme' has no API key on this worker" in refused.text, refused.text
                # the upsert embedded and wrote nothing: acme's index holds no "late"
                backend = EmbeddedBackend(Path(env["SIFT_DATA_DIR"]))
                try:
                    assert backend.stored_documents(INDEX, "acme", ["late"]) == {}
                    assert backend.stored_documents(INDEX, "acme", ["tea-1"]), "acme's kept"
                finally:
                    backend.close()

            # globex's search alone reached the model
            assert len(model.requests()) - calls_before == 1
            for job in (found, upserted, deleted):
                assert job["status"] == "failed", job
                assert job["error"]["type"] == "tenant_removed", job
                assert "acme" in job["error"]["message"], job
            assert found["error"]["usage"] is None, found  # no model call: nothing billed
            for done in (ran, eco):
                assert done["counts"]["failed"] == 4, done
                assert done["counts"]["succeeded"] == 0, done
                lines = all_results(client, done["id"])
                assert {line["error"]["type"] for line in lines} == {"tenant_removed"}, lines
            assert failures[("search", "tenant_removed")] == 1
            assert failures[("batch_item", "tenant_removed")] == 8
            assert failures[("ingest", "tenant_removed")] == 2
            # nothing left counted queued or running
            with redis.Redis.from_url(url) as store:
                stats = store.hgetall(STATS_KEY)
            assert all(int(v) == 0 for v in stats.values()), stats
            # no receiver heard of them: nothing could sign them, and the records say so
            for path in (f"/v1/searches/{search}", f"/v1/batches/{batch}"):
                webhook = client.get(path, headers=ACME).json()["webhook"]
                assert webhook == {"status": "failed", "attempts": 0}, (path, webhook)
            with pytest.raises(queue.Empty):
                inbox.get_nowait()


def test_a_removed_tenants_webhook_reads_failed_once_its_job_is_final(tmp_path: Path) -> None:
    """The webhooks queue backed up (no worker consumes it): the search and the batch of a
    removed tenant read ``failed`` after 0 attempts as soon as they are final, not ``pending``
    until a webhook task runs that can only give up. And the finish that settled them queues
    no webhook message: it queued one each, whose task found the webhook settled and dropped
    it as a copy ("settled already; this copy is dropped")."""
    with (
        redis_server(tmp_path / "redis") as base_url,
        FakeAnthropic() as model,
        webhook_inbox() as (hook, inbox),
    ):
        env = stack_env(base_url + "/0", model.url, SIFT_API_KEYS=json.dumps(BOTH))
        with (
            gateway(tmp_path / "g", env, "g1") as gateway_url,
            httpx.Client(base_url=gateway_url, timeout=30) as client,
        ):
            with celery_worker(tmp_path / "w", env, "w1", concurrency=4):
                ingest(client)
            search = client.post(
                "/v1/searches", json={"index": INDEX, "query": "bees", "webhook_url": hook},
                headers=ACME,
            ).json()["id"]  # fmt: skip
            queries = [{"id": f"q{i}", "query": "bees"} for i in range(3)]
            batch = client.post(
                "/v1/batches", json={"index": INDEX, "queries": queries, "webhook_url": hook},
                headers=ACME,
            ).json()["id"]  # fmt: skip
            removed = {**env, "SIFT_API_KEYS": json.dumps([GLOBEX_KEY])}
            with celery_worker(
                tmp_path / "w", removed, "w2", concurrency=4, queues="sift.search,sift.batch"
            ):
                found = _final(client, f"/v1/searches/{search}", ACME)
                ran = _final(client, f"/v1/batches/{batch}", ACME)
            # the worker stopped: every task that finished a job has returned
            with redis.Redis.from_url(base_url + "/0") as broker:
                queued = sum(int(broker.llen(key)) for key in kombu_queue_keys(WEBHOOK_QUEUE))
            assert queued == 0, queued
            assert found["status"] == "failed", found
            assert found["error"]["type"] == "tenant_removed", found
            assert ran["counts"]["failed"] == 3, ran
            for job in (found, ran):
                assert job["webhook"] == {"status": "failed", "attempts": 0}, job
            with pytest.raises(queue.Empty):
                inbox.get_nowait()
