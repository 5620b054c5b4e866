"""A document id with a ``.`` or ``..`` part between slashes: refused at ingest, since every
HTTP client resolves such a part in a URL before it sends (``DELETE .../documents/x/../..``
sent with the id's slashes raw, as the docs allow, reached the gateway as the index's own
``DELETE`` and dropped it; ``.../documents/a/../b`` deleted document ``b``). One stored
before the refusal stays reachable: read by its path with the dots escaped (``%2E``), and
deleted by ``POST .../documents/delete``, whose ids go in the body and are never resolved.

Everything is real: redis-server, a ``sift worker`` process, the gateway; the ids stored
before are written into the worker's data dir by the embedded backend itself.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.keys import ACME
from tests.reliability.support import INDEX, stack_env
from tests.services import celery_worker, gateway, redis_server
from worker.adapters.embedded import EmbeddedBackend
from worker.core.types import Document

pytestmark = pytest.mark.integration

OLD_IDS = ("a/../b", "x/../..", "./c")


def test_an_id_with_dot_segments_is_refused_and_one_stored_before_is_read_and_deleted(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path / "redis") as base_url, FakeAnthropic() as model:
        env = stack_env(base_url + "/0", model.url)
        backend = EmbeddedBackend(Path(env["SIFT_DATA_DIR"]))
        try:
            stored = [Document(i, f"document {i}", "", "", {}) for i in ("b", *OLD_IDS)]
            assert backend.upsert(INDEX, "acme", stored, None) == len(stored)
        finally:
            backend.close()
        with (
            celery_worker(tmp_path / "w", env, "w1", concurrency=4),
            gateway(tmp_path / "g", env, "g1") as url,
            httpx.Client(base_url=url, timeout=30, headers=ACME) as client,
        ):
            documents = f"/v1/indexes/{INDEX}/documents"
            for doc_id in ("a/../b", "x/../..", "./c", "a/.", "a/./b"):
                refused = client.post(
                    documents, json={"documents": [{"id": doc_id, "text": "new"}]}
                )
                assert refused.status_code == 422, (doc_id, refused.text)
                assert refused.json()["error"]["field"] == "documents[0].id", refused.text
            # the dots escaped, the path is the id's own: never resolved by the client
            read = client.get(f"{documents}/a/%2E%2E/b")
            assert read.status_code == 200 and read.json()["id"] == "a/../b", read.text
            deleted = client.post(
                f"{documents}/delete", params={"wait": 20}, json={"ids": list(OLD_IDS)}
            )
            assert deleted.status_code == 200, deleted.text
            assert deleted.json()["status"] == "succeeded", deleted.text
            assert deleted.json()["deleted"] == len(OLD_IDS), deleted.text
            left = client.get(documents).json()["documents"]
            assert [d["id"] for d in left] == ["b"], left
            assert client.get(f"/v1/indexes/{INDEX}").status_code == 200
