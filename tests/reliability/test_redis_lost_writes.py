"""Redis back without its last writes: the jobs that finished in that last second run again
within a minute or so, not once the visibility timeout puts their messages back.

With ``appendfsync everysec`` (as ``sift up`` and ``deploy/`` run Redis) a host crash loses
up to the last second of writes, and so does a SIGKILL while a slow fsync holds the file's
writes back (seen in CI: ``Broker.written``). A search and a batch chunk finished, acked and
dropped from ``sift:deliveries`` in that second come back ``running``, their messages back
in ``unacked`` and recorded as held by the worker, which is alive and no longer holds them:
the dead-worker check leaves a live worker's deliveries and the orphan check recorded ones,
and the re-drive counts an unacked message as covering its job, so nothing ran them before
the visibility timeout (1,600 s at the defaults). Now the worker, as its consumer starts
again, drops the records of deliveries it no longer holds
(:meth:`worker.queue.liveness.Liveness.forget_released`) and the orphan check puts them back.

The lost second is made exactly: the Redis directory is copied once the AOF holds the jobs
running (what the disk holds when the host dies), the jobs finish, redis-server is SIGKILLed
and started again on the copy. One redis-server, one gateway, one ``sift worker``, every
setting at its default.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    DOWN_SECONDS,
    answered_once,
    assert_batch_exactly_once,
    batch_counts,
    broker,
    ingest,
    sample_queries,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, gateway
from worker.constants import DELIVERY_OWNERS_KEY, KOMBU_UNACKED_KEY
from worker.processes.stack import child_env, worker_process
from worker.queue.config import visibility_timeout
from worker.settings import load_settings

pytestmark = pytest.mark.integration

ITEMS = 5


def search_status(client: httpx.Client, search_id: str) -> str:
    return str(client.get(f"/v1/searches/{search_id}", headers=ACME).json()["status"])


@pytest.mark.timeout(900)
def test_jobs_whose_finish_redis_lost_run_again_before_the_visibility_timeout(
    tmp_path: Path,
) -> None:
    with FakeAnthropic() as model, broker(tmp_path / "redis") as redis_broker:
        url = redis_broker.url + "/0"
        env = stack_env(url, model.url)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # every setting at its default
        prompt = visibility_timeout(load_settings(redis_url=url)) / 10
        with (
            celery_worker(tmp_path / "w", env, "w"),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            answered_once(client, model)  # the deployment's first answer, before the hold
            probe = redis.Redis.from_url(url, decode_responses=True)
            model.configure(hold_unscripted=True)  # both wait on the model till the copy
            search_id = submit_search(client, sample_queries()[0])
            batch_id = submit_batch(client, ITEMS)

            def statuses() -> tuple[str, str]:
                return search_status(client, search_id), batch_counts(client, batch_id)["status"]

            wait_for(lambda: statuses() == ("running", "running"), "both running")
            # the search's and the chunk's deliveries recorded as the worker's
            wait_for(lambda: probe.hlen(DELIVERY_OWNERS_KEY) == 2, "their deliveries recorded")
            assert probe.hlen(KOMBU_UNACKED_KEY) == 2
            redis_broker.written(probe)
            disk = tmp_path / "disk"  # what the disk holds when the host dies
            shutil.copytree(redis_broker.directory, disk)
            model.configure(hold_unscripted=False)
            wait_for(lambda: statuses() == ("succeeded", "succeeded"), "both done")
            wait_for(lambda: probe.hlen(KOMBU_UNACKED_KEY) == 0, "their messages acked")
            wait_for(lambda: probe.hlen(DELIVERY_OWNERS_KEY) == 0, "their records dropped")
            probe.close()
            redis_broker.kill(signal.SIGKILL)
            shutil.rmtree(redis_broker.directory)
            shutil.copytree(disk, redis_broker.directory)
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            restarted = time.monotonic()
            assert statuses() == ("running", "running")  # their finishes were lost
            wait_for(lambda: statuses() == ("succeeded", "succeeded"), "both run again", prompt)
            took = time.monotonic() - restarted
            assert_batch_exactly_once(client, url, batch_id, ITEMS)
            probe = redis.Redis.from_url(url, decode_responses=True)
            wait_for(lambda: probe.hlen(KOMBU_UNACKED_KEY) == 0, "nothing left unacked", 30)
            probe.close()
    print(f"\nboth succeeded again {took:.1f} s after the restart (a tenth of the visibility "
          f"timeout: {prompt:g} s)")  # fmt: skip


@pytest.mark.timeout(900)
def test_an_ingest_whose_finish_redis_lost_runs_again_before_its_claim_s_lease(
    tmp_path: Path,
) -> None:
    """An ingest finished, acked and its record dropped in the lost second comes back
    ``running``, and so does its run claim, naming the live worker, leased for the ingest's
    630 s. The copy the orphan check puts back runs on that worker, where no run holds the
    claim: it takes it over and finishes the job (its documents already written: counted as
    written), not refused as "another run holds it" until the lease is over."""
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    documents = [
        {"id": "held", "text": "hold-embedding: its embedding waits for the copy of the disk"},
        {"id": "kept", "text": "calcium and bone density"},
    ]
    with FakeAnthropic() as model, broker(tmp_path / "redis") as redis_broker:
        url = redis_broker.url + "/0"
        env = stack_env(
            url,
            model.url,
            SIFT_RUNTIME_FACTORY="tests.reliability.crashing_runtime:build_runtime",
            CRASH_ONCE_DIR=str(crashes),
        )
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # every setting at its default
        prompt = visibility_timeout(load_settings(redis_url=url)) / 10  # 160 s: < the lease
        with (
            worker_process(tmp_path / "w", child_env(env, inherit_sift=False)) as proc,
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            response = client.post(
                "/v1/indexes/docs/documents", json={"documents": documents}, headers=ACME
            )
            assert response.status_code == 202, response.text
            path = f"/v1/ingestions/{response.json()['id']}"

            def status() -> str:
                return str(client.get(path, headers=ACME).json()["status"])

            probe = redis.Redis.from_url(url, decode_responses=True)
            wait_for(lambda: (crashes / "hold-embedding").exists(), "the ingest embedding")
            wait_for(lambda: probe.hlen(DELIVERY_OWNERS_KEY) == 1, "its delivery recorded")
            redis_broker.written(probe)
            disk = tmp_path / "disk"  # what the disk holds when the host dies
            shutil.copytree(redis_broker.directory, disk)
            (crashes / "release").touch()
            wait_for(lambda: status() == "succeeded", "the ingest done")
            wait_for(lambda: probe.hlen(KOMBU_UNACKED_KEY) == 0, "its message acked")
            wait_for(lambda: probe.hlen(DELIVERY_OWNERS_KEY) == 0, "its record dropped")
            probe.close()
            redis_broker.kill(signal.SIGKILL)
            shutil.rmtree(redis_broker.directory)
            shutil.copytree(disk, redis_broker.directory)
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            assert status() == "running"  # its finish was lost
            wait_for(lambda: status() == "succeeded", "the ingest run again", prompt)
            done = client.get(path, headers=ACME).json()
            assert proc.poll() is None  # the same worker
    assert done["upserted"] == len(documents), done
