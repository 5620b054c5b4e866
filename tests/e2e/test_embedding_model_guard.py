"""Vectors of two embedding models never meet in one index, over the real stack: a worker
whose embedder differs (``SIFT_EMBEDDING_INT8_COMPUTE`` toggled changes its model id) is
refused an ingest into an index another model wrote, writing nothing, and a vector or hybrid
search of it; fts still serves, and after a drop the index takes the new model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import ACME, KEYS
from tests.services import celery_worker, gateway, redis_server
from worker.adapters.embedder import INT8_COMPUTE_SUFFIX, MODEL_ID

INDEX = "guarded"
FIRST = MODEL_ID + INT8_COMPUTE_SUFFIX  # the default: SIFT_EMBEDDING_INT8_COMPUTE=true
SECOND = MODEL_ID  # SIFT_EMBEDDING_INT8_COMPUTE=false
DOCS = [
    {"id": "g1", "text": "okapi stripes in the ituri forest"},
    {"id": "g2", "text": "narwhal tusks under arctic ice"},
    {"id": "g3", "text": "axolotl gills regrow in mexican lakes"},
]


def _ingest(client: httpx.Client, docs: list[dict[str, Any]]) -> dict[str, Any]:
    response = client.post(
        f"/v1/indexes/{INDEX}/documents",
        params={"wait": 30},
        json={"documents": docs},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _search(client: httpx.Client, mode: str) -> dict[str, Any]:
    response = client.post(
        "/v1/searches",
        params={"wait": 30},
        json={"index": INDEX, "query": "okapi forest", "mode": mode},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _index(client: httpx.Client) -> dict[str, Any]:
    response = client.get(f"/v1/indexes/{INDEX}", headers=ACME)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_another_models_worker_is_refused_until_the_index_is_dropped(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as redis_url:
        env = {
            "SIFT_API_KEYS": json.dumps(KEYS),
            "SIFT_DATA_DIR": str(tmp_path / "data"),
            "SIFT_REDIS_URL": redis_url + "/0",
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        }
        with (
            gateway(tmp_path / "g", env, "guard") as url,
            httpx.Client(base_url=url, timeout=40) as client,
        ):
            with celery_worker(tmp_path / "w", env, "first", concurrency=4):
                written = _ingest(client, DOCS)
                assert written["status"] == "succeeded" and written["upserted"] == 3, written
                assert _index(client)["embedding_model"] == FIRST
                assert _search(client, "hybrid")["status"] == "succeeded"

            other = {**env, "SIFT_EMBEDDING_INT8_COMPUTE": "false"}
            with celery_worker(tmp_path / "w", other, "second", concurrency=4):
                replacing = [{"id": "g1", "text": "replaced"}, {"id": "g4", "text": "new"}]
                refused = _ingest(client, replacing)
                assert refused["status"] == "failed", refused
                error = refused["error"]
                assert error["type"] == "embedding_model_mismatch" and not error["retryable"]
                assert FIRST in error["message"] and repr(SECOND) in error["message"]
                assert "drop" in error["message"]
                shown = _index(client)  # nothing written: no partial mix
                assert shown["documents"] == 3 and shown["embedding_model"] == FIRST
                g1 = client.get(f"/v1/indexes/{INDEX}/documents/g1", headers=ACME).json()
                assert g1["text"] == DOCS[0]["text"]

                for mode in ("vector", "hybrid"):
                    job = _search(client, mode)
                    assert job["status"] == "failed", job
                    assert job["error"]["type"] == "embedding_model_mismatch"
                    assert not job["error"]["retryable"]
                fts = _search(client, "fts")
                assert fts["status"] == "succeeded" and fts["result"]["hits"][0]["id"] == "g1"

                dropped = client.delete(f"/v1/indexes/{INDEX}", params={"wait": 30}, headers=ACME)
                assert dropped.status_code == 200 and dropped.json()["deleted"] == 3
                again = _ingest(client, DOCS)
                assert again["status"] == "succeeded" and again["upserted"] == 3, again
                assert _index(client)["embedding_model"] == SECOND
                hybrid = _search(client, "hybrid")
                assert hybrid["status"] == "succeeded" and hybrid["result"]["hits"][0]["id"] == "g1"
