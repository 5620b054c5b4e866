"""A live worker on a Redis at its ``maxmemory`` (``noeviction``) keeps its heartbeat.

The heartbeat was a ``SET``, which Redis refuses at its limit however small: every beat was
refused while Redis was full, so after ``SIFT_WORKER_DEAD_AFTER_SECONDS`` a live worker read
as dead, to ``sift status`` and to any other worker's check that got through, which put back
the deliveries it was still running (run twice, billed twice). The beat is a script flagged
``allow-oom`` now (:data:`worker.queue.liveness.BEAT_SCRIPT`): it rewrites a key of the same
size.

A real ``sift worker`` at the defaults (a beat every 2 s, dead after 10 s), a real
redis-server whose ``maxmemory`` is set below what it holds: it refuses every write that may
grow it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.reliability.support import wait_for
from tests.services import celery_worker, redis_server
from worker.constants import WORKER_HEARTBEAT_KEY, WORKERS_KEY
from worker.settings import Settings

pytestmark = pytest.mark.integration

DEAD_AFTER = Settings.model_fields["worker_dead_after_seconds"].default


@pytest.mark.timeout(300)
def test_a_live_worker_keeps_its_heartbeat_while_redis_is_full(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as base:
        env = {"SIFT_REDIS_URL": base + "/0", "SIFT_WORKER_METRICS_PORT": "0"}
        with (
            celery_worker(tmp_path / "w", env, "w1") as worker,
            redis.Redis.from_url(base + "/0", decode_responses=True) as r,
        ):
            wait_for(lambda: bool(r.keys(WORKER_HEARTBEAT_KEY + "*")), "the first beat")
            [key] = r.keys(WORKER_HEARTBEAT_KEY + "*")
            worker_id = key.removeprefix(WORKER_HEARTBEAT_KEY)
            r.config_set("maxmemory", int(r.info("memory")["used_memory"]) // 2)
            try:
                with pytest.raises(redis.exceptions.OutOfMemoryError):
                    r.set("probe", "x")  # full: a write is refused
                seconds, micros = r.time()
                full_at = seconds + micros / 1e6
                beats: set[float] = set()

                def beaten_past_its_ttl() -> bool:
                    beat = r.get(key)
                    assert beat is not None, f"the heartbeat expired, {len(beats)} beat(s) seen"
                    beats.add(float(beat))
                    return float(beat) > full_at + DEAD_AFTER

                wait_for(beaten_past_its_ttl, "a beat past the heartbeat's TTL", 6 * DEAD_AFTER)
                assert r.sismember(WORKERS_KEY, worker_id)
                assert worker.poll() is None
            finally:
                r.config_set("maxmemory", 0)
