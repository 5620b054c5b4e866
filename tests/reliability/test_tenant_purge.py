"""``sift tenant purge``: a removed tenant's jobs, results, records and indexes erased, and
nothing of it left in Redis or the backend.

Before, removing a tenant's keys erased nothing and there was no way to: its results (hit
texts included), queries, Idempotency-Keys and job lists stayed in Redis for the retention
window, its documents in the backend for good, and a tenant given the name again inherited
them. The test runs everything real (redis-server, ``sift worker``, the gateway, the fake
Messages API, the command as its own process): tenant acme finishes work of every kind and
leaves more queued, globex works beside it; then the command refuses while acme has a key,
stops at the confirmation when told no, and, acme's keys removed, erases it: after a worker
has drained the queues, no Redis key, member, field or value names acme or one of its job
ids, its indexes are gone from the backend, globex's data is untouched, and a second run
removes nothing.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.keys import ACME, ACME_KEY, GLOBEX, GLOBEX_KEY
from tests.reliability.support import INDEX, ingest, stack_env, wait_for
from tests.services import celery_worker, gateway, redis_server, webhook_inbox
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import (
    ALL_QUEUES,
    KOMBU_UNACKED_KEY,
    REWRITE_LATCH_KEY,
    REWRITE_OWED_KEY,
    STATS_KEY,
    kombu_queue_keys,
)
from worker.processes.stack import child_env
from worker.write_versions import next_write_version

pytestmark = pytest.mark.integration

BOTH = [ACME_KEY, GLOBEX_KEY]


def _purge(env: dict[str, str], *args: str, answer: str = "") -> subprocess.CompletedProcess[str]:
    """``sift tenant purge`` as its own process, on ``env``'s settings."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", *args],
        env=child_env({**env, "COLUMNS": "200", "NO_COLOR": "1"}, inherit_sift=False),
        input=answer, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _removed(output: str) -> dict[str, int]:
    """The command's table: each row's count by its label."""
    rows = re.findall(r"│\s*([a-zA-Z][^│]*?)\s*│\s*(\d+)\s*│", output)
    return {label: int(count) for label, count in rows}


def _final(client: httpx.Client, path: str, headers: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = {}

    def done() -> bool:
        nonlocal body
        body = client.get(path, headers=headers).json()
        return bool(body.get("finished_at"))

    wait_for(done, path)
    return body


def _naming(client: redis.Redis, names: set[str]) -> list[str]:
    """Every key whose name, or any member, field or value it holds, names one of ``names``."""
    found = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == "string":
            held = [client.get(key) or ""]
        elif kind == "hash":
            held = [f"{k} {v}" for k, v in client.hgetall(key).items()]
        elif kind == "zset":
            held = [str(member) for member in client.zrange(key, 0, -1)]
        elif kind == "set":
            held = [str(member) for member in client.smembers(key)]
        elif kind == "list":
            held = [str(item) for item in client.lrange(key, 0, -1)]
        else:
            held = []
        if any(name in text for name in names for text in [key, *held]):
            found.append(f"{kind} {key}")
    return found


def test_a_purge_erases_a_removed_tenant_and_nothing_else(tmp_path: Path) -> None:
    with (
        redis_server(tmp_path / "redis") as base_url,
        FakeAnthropic() as model,
        webhook_inbox() as (hook, inbox),
    ):
        url = base_url + "/0"
        env = stack_env(url, model.url, SIFT_API_KEYS=json.dumps(BOTH))
        data_dir = Path(env["SIFT_DATA_DIR"])
        acme_jobs: set[str] = set()
        with (
            gateway(tmp_path / "g", env, "g1") as gateway_url,
            httpx.Client(base_url=gateway_url, timeout=30) as client,
        ):
            with celery_worker(tmp_path / "w", env, "w1", concurrency=8):
                documents = ingest(client)  # acme's "docs"
                notes = client.post(
                    "/v1/indexes/notes/documents", params={"wait": 30},
                    json={"documents": [{"id": "n1", "text": "a private note of acme's"}]},
                    headers=ACME,
                ).json()  # fmt: skip
                assert notes["status"] == "succeeded", notes
                patched = client.patch(
                    f"/v1/indexes/{INDEX}", json={"candidate_limit": 40}, headers=ACME
                )
                assert patched.status_code == 200, patched.text
                globex_docs = ingest(client, GLOBEX)
                searched = client.post(
                    "/v1/searches", json={"index": INDEX, "query": "bees", "webhook_url": hook},
                    headers={**ACME, "Idempotency-Key": "acme-once"},
                ).json()["id"]  # fmt: skip
                queries = [{"id": f"q{i}", "query": "bees"} for i in range(3)]
                batch = client.post(
                    "/v1/batches", json={"index": INDEX, "queries": queries}, headers=ACME
                ).json()["id"]
                theirs = client.post(
                    "/v1/searches", json={"index": INDEX, "query": "bees"}, headers=GLOBEX
                ).json()["id"]
                _final(client, f"/v1/searches/{searched}", ACME)
                _final(client, f"/v1/batches/{batch}", ACME)
                _final(client, f"/v1/searches/{theirs}", GLOBEX)
                inbox.get(timeout=30)  # the search's webhook, delivered
            # the workers are stopped: acme queues more
            queued = client.post(
                "/v1/searches", json={"index": INDEX, "query": "honey"}, headers=ACME
            ).json()["id"]
            waiting = client.post(
                "/v1/batches", json={"index": INDEX, "queries": queries}, headers=ACME
            ).json()["id"]
            listed = [
                client.get(f"/v1/{kind}", params={"page_size": 100}, headers=ACME).json()
                for kind in ("searches", "batches", "ingestions")
            ]
            for page in listed:
                for entries in page.values():
                    if isinstance(entries, list):
                        acme_jobs |= {entry["id"] for entry in entries}
            assert {searched, batch, queued, waiting} <= acme_jobs
            assert len(acme_jobs) == 6  # 2 searches, 2 batches, 2 ingests

            # acme still has a key: refused, nothing removed
            refused = _purge(env, "acme", "--yes")
            assert refused.returncode == 1, refused
            assert "--force" in refused.stderr and "still has a key" in refused.stderr
            assert client.get(f"/v1/searches/{searched}", headers=ACME).status_code == 200

            # acme's keys removed; the operator answers no: nothing removed
            removed_env = {**env, "SIFT_API_KEYS": json.dumps([GLOBEX_KEY])}
            declined = _purge(removed_env, "acme", answer="n\n")
            assert declined.returncode == 1, declined
            assert "Erase tenant 'acme'" in declined.stdout, declined
            assert client.get(f"/v1/searches/{searched}", headers=ACME).status_code == 200

            purged = _purge(removed_env, "acme", "--yes")
            assert purged.returncode == 0, purged
            removed = _removed(purged.stdout)
            assert removed["searches canceled"] == 1, purged.stdout
            assert removed["batch items canceled"] == 3, purged.stdout
            assert removed["indexes dropped"] == 2, purged.stdout
            assert removed["documents dropped"] == documents + 1, purged.stdout
            assert removed["searches deleted"] == 2, purged.stdout
            assert removed["batches deleted"] == 2, purged.stdout
            assert removed["ingests deleted"] == 2, purged.stdout
            assert removed["idempotency keys deleted"] == 1, purged.stdout
            with redis.Redis.from_url(url, decode_responses=True) as store:
                # the queued work canceled, not just deleted: nothing counted queued any more
                stats = store.hgetall(STATS_KEY)
                assert all(int(v) == 0 for v in stats.values()), stats

                # a worker without acme's key takes what was queued (no record: nothing)
                with celery_worker(tmp_path / "w", removed_env, "w2", concurrency=8):

                    def drained() -> bool:
                        ready = sum(
                            store.llen(key) for q in ALL_QUEUES for key in kombu_queue_keys(q)
                        )
                        return ready == 0 and store.hlen(KOMBU_UNACKED_KEY) == 0

                    wait_for(drained, "the queues drained")
                    assert client.get(f"/v1/searches/{theirs}", headers=GLOBEX).status_code == 200
                    assert client.get(f"/v1/searches/{searched}", headers=ACME).status_code == 404
                    left = _naming(store, {"acme", *acme_jobs})
                    assert left == [], left

            backend = EmbeddedBackend(data_dir)
            try:
                assert backend.indexes("acme") == []
                assert backend.index_info(INDEX, "acme") is None
                assert backend.document("notes", "acme", "n1") is None
                assert [(i.name, i.documents) for i in backend.indexes("globex")] == [
                    (INDEX, globex_docs)
                ]
            finally:
                backend.close()

            # a second run finds nothing
            again = _purge(removed_env, "acme", "--yes")
            assert again.returncode == 0, again
            assert "tenant 'acme': nothing of it was found" in again.stdout, again.stdout
            assert not _removed(again.stdout), again.stdout

            # the name given out again inherits nothing, and its writes land (the drops'
            # floors are below every new write version)
            with celery_worker(tmp_path / "w", env, "w3", concurrency=8):
                # its warm-up done first: an index read waits for the runtime it builds,
                # past the gateway's 10 s on a loaded host (a CI's 503)
                log = tmp_path / "w" / "w3.log"
                wait_for(lambda: "loaded embedding model" in log.read_text(), "w3's warm-up")
                listed = client.get("/v1/searches", headers=ACME).json()
                assert listed["searches"] == [], listed
                assert client.get(f"/v1/indexes/{INDEX}", headers=ACME).status_code == 404
                fresh = client.post(
                    "/v1/indexes/notes/documents", params={"wait": 30},
                    json={"documents": [{"id": "n2", "text": "the new tenant's note"}]},
                    headers=ACME,
                ).json()  # fmt: skip
                assert (fresh["status"], fresh["upserted"]) == ("succeeded", 1), fresh
                index = client.get("/v1/indexes/notes", headers=ACME).json()
                assert index["documents"] == 1, index
                # with its key back, only --force erases it
                forced = _purge(env, "acme", "--yes", "--force")
                assert forced.returncode == 0, forced
                removed = _removed(forced.stdout)
                assert (removed["indexes dropped"], removed["ingests deleted"]) == (1, 1), forced
                assert client.get("/v1/indexes/notes", headers=ACME).status_code == 404


def test_a_purge_without_the_backends_data_folder_erases_nothing(tmp_path: Path) -> None:
    """Given the deployment's Redis but not its SIFT_DATA_DIR, the purge made an empty sift.db
    where it ran, "dropped" its 0 indexes, deleted every Redis record and exited 0, the
    tenant's documents left in the real backend. It stops before deleting anything now."""
    with redis_server(tmp_path / "redis") as base_url:
        url = base_url + "/0"
        client = redis.Redis.from_url(url, decode_responses=True)
        next_write_version(client, "acme")
        before = sorted(client.scan_iter())
        assert before  # acme's write-version counter
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        env = {"SIFT_REDIS_URL": url, "COLUMNS": "200", "NO_COLOR": "1"}
        purged = subprocess.run(
            [sys.executable, "-m", "worker.cli", "tenant", "purge", "acme", "--yes"],
            cwd=elsewhere, env=child_env(env, inherit_sift=False),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert purged.returncode == 1, purged.stdout + purged.stderr
        assert "SIFT_DATA_DIR" in purged.stderr and "Traceback" not in purged.stderr
        assert sorted(client.scan_iter()) == before
        assert not list(elsewhere.rglob("sift.db")), list(elsewhere.rglob("*"))


def test_a_purge_given_another_folder_than_the_live_workers_erases_nothing(
    tmp_path: Path,
) -> None:
    """Given a SIFT_DATA_DIR holding a sift.db that is not the folder the live workers serve
    (one a refused `sift worker` left, a copy, a developer's), the purge dropped the tenant's
    indexes there, none, deleted every Redis record and exited 0, its documents left in the
    workers' folder. It stops before erasing anything now, naming the workers' folder; given
    that folder, it runs."""
    served, other = tmp_path / "served", tmp_path / "other"
    other.mkdir()
    sqlite3.connect(other / "sift.db").close()
    with redis_server(tmp_path / "redis") as base_url:
        url = base_url + "/0"
        env = {"SIFT_REDIS_URL": url, "SIFT_DATA_DIR": str(served)}
        with celery_worker(tmp_path, {**env, "SIFT_WORKER_METRICS_PORT": "0"}, "w"):
            client = redis.Redis.from_url(url, decode_responses=True)
            next_write_version(client, "acme")
            counter = "sift:write-version:acme"
            assert client.exists(counter)

            purged = _purge({**env, "SIFT_DATA_DIR": str(other)}, "acme", "--yes")
            assert purged.returncode == 1, purged.stdout + purged.stderr
            said = " ".join(purged.stderr.split())
            assert "SIFT_DATA_DIR" in said and str(served.resolve()) in said, said
            assert "Traceback" not in purged.stderr
            assert client.exists(counter)  # nothing erased

            purged = _purge(env, "acme", "--yes")  # the workers' own folder
            assert purged.returncode == 0, purged.stdout + purged.stderr
            assert not client.exists(counter)


def test_an_ingest_into_a_new_index_running_at_the_purge_lands_nothing_after_it(
    tmp_path: Path,
) -> None:
    """An ingest of acme's into an index it never had documents in, held mid-run (its
    embedding waits) while the purge runs, then let go: it writes nothing, and acme lists no
    index. Before, the purge dropped only the indexes holding documents when it ran, so the
    new index got no floor: the purge said "ingests canceled 1", the ingest's record answered
    404, and the worker still wrote every document after the purge had ended, listed and
    served by the gateway."""
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    with redis_server(tmp_path / "redis") as base_url, FakeAnthropic() as model:
        url = base_url + "/0"
        env = stack_env(
            url, model.url, SIFT_API_KEYS=json.dumps(BOTH),
            SIFT_RUNTIME_FACTORY="tests.reliability.crashing_runtime:build_runtime",
            CRASH_ONCE_DIR=str(crashes),
        )  # fmt: skip
        removed_env = {**env, "SIFT_API_KEYS": json.dumps([GLOBEX_KEY])}
        documents = [
            {"id": "held", "text": "hold-embedding: a secret of acme's"},
            *({"id": f"s{i}", "text": f"a confidential record of acme's {i}"} for i in range(3)),
        ]
        with (
            gateway(tmp_path / "g", env, "g1") as gateway_url,
            httpx.Client(base_url=gateway_url, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w1", concurrency=4),
            redis.Redis.from_url(url, decode_responses=True) as store,
        ):
            accepted = client.post(
                "/v1/indexes/fresh/documents", json={"documents": documents}, headers=ACME
            )
            assert accepted.status_code == 202, accepted.text
            job_id = accepted.json()["id"]
            wait_for(lambda: (crashes / "hold-embedding").exists(), "the ingest embedding")
            status = client.get(f"/v1/ingestions/{job_id}", headers=ACME).json()["status"]
            assert status == "running", status

            purged = _purge(removed_env, "acme", "--yes")
            assert purged.returncode == 0, purged.stdout + purged.stderr
            removed = _removed(purged.stdout)
            assert removed["ingests canceled"] == 1, purged.stdout
            (crashes / "release").touch()  # the worker (not restarted) goes on with the ingest

            def drained() -> bool:
                ready = sum(store.llen(key) for q in ALL_QUEUES for key in kombu_queue_keys(q))
                return ready == 0 and store.hlen(KOMBU_UNACKED_KEY) == 0

            wait_for(drained, "the ingest's run ended")
            listed = client.get("/v1/indexes", headers=ACME)  # its key is still in the gateway
            assert listed.status_code == 200, listed.text
            assert listed.json()["indexes"] == [], listed.json()
        backend = EmbeddedBackend(Path(env["SIFT_DATA_DIR"]))
        try:
            assert backend.indexes("acme") == []
            assert backend.documents("fresh", "acme", None, 10) is None
            assert [backend.document("fresh", "acme", d["id"]) for d in documents] == [None] * 4
        finally:
            backend.close()
        closed = removed["indexes only its unfinished writes named, closed to them"]
        assert (removed["indexes dropped"], closed) == (0, 1), purged.stdout
        again = _purge(removed_env, "acme", "--yes")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "tenant 'acme': nothing of it was found" in again.stdout, again.stdout


def test_a_tenant_never_seen_is_said_to_be_found_nowhere(tmp_path: Path) -> None:
    """``sift tenant purge ghost`` of a name nothing holds (a typo, or a tenant purged
    already) says nothing of it was found, exit 0, and asks Redis for no rewrite: it printed
    ``tenant ghost: purged`` with every count 0, as a finished erasure, and made one."""
    with redis_server(tmp_path / "redis") as base_url:
        env = stack_env(base_url + "/0", "http://127.0.0.1:9", SIFT_API_KEYS=json.dumps(BOTH))
        with (
            gateway(tmp_path / "g", env) as gateway_url,
            httpx.Client(base_url=gateway_url, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w1", concurrency=2),
        ):
            ingest(client)  # acme's index, in the workers' folder
            ghost = _purge(env, "ghost", "--yes")
        with redis.Redis.from_url(base_url) as store:
            asked = store.exists(REWRITE_LATCH_KEY, REWRITE_OWED_KEY)
    assert ghost.returncode == 0, ghost.stdout + ghost.stderr
    said = " ".join(ghost.stdout.split())
    assert "tenant 'ghost': nothing of it was found" in said, said
    assert "purged" not in said and "Redis was asked" not in said, said
    assert asked == 0  # no rewrite asked, none owed
