"""The ingestion ``GET /v1/ingestions`` lists as the newest is the write the index keeps, on a
real gateway and ``sift worker`` at their defaults.

Two upserts of one document: the first one's documents are held on their way to Redis (the
proxy of :mod:`tests.reliability.replyloss`, armed with their text, calls ``before`` there),
and the second is sent and accepted meanwhile, then the first goes on. Its write version was
taken before its documents were sent, and its date after, so the second, accepted in
between, held the higher version (its text the one the index kept) yet was listed as the
older write: a client reading the listing took the first one's text for the document's.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.reliability.replyloss import ReplyLoss
from tests.reliability.support import ACME, INDEX, KEYS, wait_for
from tests.services import celery_worker, gateway, redis_server

pytestmark = pytest.mark.integration

DOCS = f"/v1/indexes/{INDEX}/documents"
HELD = "held on the wire: the first upsert"  # in its documents only, which the proxy holds


def _final(client: httpx.Client, job_id: str) -> bool:
    status = client.get(f"/v1/ingestions/{job_id}", headers=ACME).json()["status"]
    return status in ("succeeded", "failed", "canceled")


@pytest.mark.timeout(180)
def test_the_newest_listed_ingestion_is_the_write_the_index_keeps(tmp_path: Path) -> None:
    with (
        redis_server(tmp_path / "redis") as url,
        ReplyLoss(int(url.rsplit(":", 1)[1])) as proxy,
    ):
        env = {"SIFT_REDIS_URL": proxy.url + "/0", "SIFT_API_KEYS": json.dumps(KEYS)}
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
            httpx.Client(base_url=base, timeout=60) as other,
            celery_worker(tmp_path / "w", env, "w"),
        ):
            meanwhile: list[httpx.Response] = []

            def accept_another() -> None:  # in the proxy, the first one's documents held
                second = {"documents": [{"id": "d", "text": "accepted meanwhile"}]}
                meanwhile.append(other.post(DOCS, json=second, headers=ACME))

            proxy.arm(HELD.encode(), before=accept_another)
            first = client.post(DOCS, json={"documents": [{"id": "d", "text": HELD}]}, headers=ACME)
            assert proxy.fired.is_set(), "the first upsert's documents were never held"
            assert first.status_code == 202, first.text
            assert meanwhile and meanwhile[0].status_code == 202, meanwhile
            ids = {"first": first.json()["id"], "second": meanwhile[0].json()["id"]}
            wait_for(lambda: all(_final(client, j) for j in ids.values()), "both final", 120)
            listed = client.get("/v1/ingestions", headers=ACME).json()["ingestions"]
            doc = client.get(f"{DOCS}/d", headers=ACME)
            assert doc.status_code == 200, doc.text
        assert [j["status"] for j in listed] == ["succeeded", "succeeded"], listed
        # the first committed last, so it is listed as the newest write: its text is the one
        # kept (before, the second's was, which the listing showed as the older write)
        assert [j["id"] for j in listed] == [ids["first"], ids["second"]]
        assert doc.json()["text"] == HELD
