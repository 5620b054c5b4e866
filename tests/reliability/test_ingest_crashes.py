"""A worker SIGKILLed mid-ingest or mid-delete leaves no job stuck, doubled or mislabelled.

The real stack at its defaults (redis-server with AOF ``everysec`` as ``sift up`` runs it,
the gateway under uvicorn, ``sift worker``), the worker's real runtime with one kill point
(:mod:`tests.reliability.crashing_runtime`): worker A dies at the point, then worker B
starts and its dead-worker check gives A's message back (the broker's visibility timeout,
about 27 minutes, is not waited for). Afterwards the job's status, its ``upserted`` or
``deleted``, the documents present and ``sift_jobs_completed_total`` all agree, and no job
is left ``running``:

- killed while embedding, or inside the SQLite write transaction (rolled back): the job
  runs again and writes every document once;
- killed after the upsert's commit, before the job record moved: the job runs again,
  changes nothing, and still reports every document written;
- killed after a delete's commit, or a drop's, before its job record moved: the job
  reports the documents its first run deleted (it reported 0 before the fix);
- killed inside the write transaction with another worker running: a write sent right after
  is taken by the other and lands (the dead one's SQLite lock went with it);
- an ingest killed while embedding, then a delete of its ids (or a drop of its index)
  accepted after it: whichever of the two B runs first, the delete wins;
- Redis SIGKILLed and started again (from its AOF) while an ingest is being embedded: the
  same worker finishes the job once, with every document written;
- the worker's broker connection killed (Redis up) while an ingest is being embedded: kombu
  puts the message back and the worker takes it again; the copy leaves the job to the run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, DOWN_SECONDS, INDEX, broker, stack_env, wait_for
from tests.services import free_port, gateway, redis_server
from worker.constants import INGEST_QUEUE, KOMBU_UNACKED_KEY
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

KEPT = [{"id": f"k{i}", "text": f"calcium and bone density note {i}"} for i in range(3)]


class Crash(NamedTuple):
    client: httpx.Client
    env: dict[str, str]
    directory: Path


def crash_env(redis_url: str, model_url: str, crashes: Path) -> dict[str, str]:
    """The stack's environment at the defaults, its kill points recorded in ``crashes``."""
    env = stack_env(
        redis_url,
        model_url,
        SIFT_RUNTIME_FACTORY="tests.reliability.crashing_runtime:build_runtime",
        CRASH_ONCE_DIR=str(crashes),
    )
    env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # its default
    return env


class Shared(NamedTuple):
    client: httpx.Client  # the module's gateway's
    redis_url: str
    model_url: str


@contextmanager
def shared_stack(tmp: Path) -> Iterator[Shared]:
    """redis-server (AOF everysec) and the gateway at the defaults, in ``tmp``."""
    with (
        FakeAnthropic() as model,
        redis_server(tmp / "redis", appendonly=True) as base_url,
    ):
        env = crash_env(base_url + "/0", model.url, tmp / "unused")
        with (
            gateway(tmp / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            yield Shared(client, base_url + "/0", model.url)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """The stack for every test of the module (:func:`crash_stack` empties it between
    tests); the workers are each test's own (a gateway of its own took 1 to 4 s of each
    test)."""
    with shared_stack(tmp_path_factory.mktemp("crashes")) as stack:
        yield stack


@contextmanager
def own_crash_stack(tmp_path: Path) -> Iterator[Crash]:
    """:func:`crash_stack` on a stack of the test's own (other modules' tests)."""
    with shared_stack(tmp_path) as stack, crash_stack(stack, tmp_path) as crash:
        yield crash


@contextmanager
def crash_stack(shared: Shared, tmp_path: Path) -> Iterator[Crash]:
    """The module's stack as a test of its own finds it: the Redis database emptied (no job,
    message or worker record of an earlier test); its workers' environment with a data
    folder of their own and their kill points in ``tmp_path``, none of them passed yet."""
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    with redis.Redis.from_url(shared.redis_url) as direct:
        direct.flushdb()
    yield Crash(shared.client, crash_env(shared.redis_url, shared.model_url, crashes), tmp_path)


@contextmanager
def worker(crash: Crash, name: str, metrics_port: int = 0) -> Iterator[Any]:
    env = {**crash.env, "SIFT_WORKER_METRICS_PORT": str(metrics_port)}
    with worker_process(crash.directory / "w", child_env(env, inherit_sift=False), name) as proc:
        yield proc


def post(client: httpx.Client, path: str, body: Any = None, method: str = "POST") -> str:
    response = client.request(method, path, json=body, headers=ACME)
    assert response.status_code in (200, 202), response.text
    return str(response.json()["id"])


def upsert(client: httpx.Client, documents: list[dict[str, Any]], index: str = INDEX) -> str:
    return post(client, f"/v1/indexes/{index}/documents", {"documents": documents})


def delete(client: httpx.Client, ids: list[str]) -> str:
    return post(client, f"/v1/indexes/{INDEX}/documents/delete", {"ids": ids})


def job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/ingestions/{job_id}", headers=ACME)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def final(client: httpx.Client, job_id: str) -> dict[str, Any]:
    wait_for(lambda: job(client, job_id)["status"] in ("succeeded", "failed"), job_id, 120)
    return job(client, job_id)


def present(client: httpx.Client, ids: list[str], index: str = INDEX) -> set[str]:
    """Which of ``ids`` the tenant's index holds (read through a worker)."""
    found = set()
    for doc_id in ids:
        response = client.get(f"/v1/indexes/{index}/documents/{doc_id}", headers=ACME)
        assert response.status_code in (200, 404), response.text
        if response.status_code == 200:
            found.add(doc_id)
    return found


def completed(port: int) -> dict[str, float]:
    """``sift_jobs_completed_total{kind="ingest"}`` by status (those above 0), as worker B
    serves it."""
    out: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "sift_jobs_completed":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["kind"] == "ingest":
                    status = sample.labels["status"]
                    out[status] = out.get(status, 0.0) + sample.value
    return {status: n for status, n in out.items() if n}


def drained(env: dict[str, str]) -> None:
    """The broker holds no message any more: none queued, none taken and not yet acked. So
    a duplicate of a job (a second restore of its message) would have run by now, and
    ``sift_jobs_completed_total`` read after this counts it: no sleep that can end first."""
    with redis.Redis.from_url(env["SIFT_REDIS_URL"]) as client:
        wait_for(
            lambda: not client.llen(INGEST_QUEUE) and not client.hlen(KOMBU_UNACKED_KEY),
            "the broker drained",
        )


def killed(proc: Any) -> None:
    """Worker A died by its kill point (SIGKILL), not otherwise."""
    assert proc.wait(120) == -9


def recovered_by_the_dead_worker_check(crash: Crash) -> None:
    log = (crash.directory / "w" / "b.log").read_text(errors="replace")
    assert "of dead worker" in log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["die-embedding", "die-in-write", "die-after-write"])
def test_an_ingest_whose_worker_was_killed_runs_again_once_and_says_what_it_wrote(
    shared: Shared, tmp_path: Path, point: str
) -> None:
    marker = {"id": point, "text": f"{point}: a document whose ingest kills its worker"}
    documents = [marker, *KEPT]
    ids = [d["id"] for d in documents]
    with crash_stack(shared, tmp_path) as crash:
        with worker(crash, "a") as worker_a:
            job_id = upsert(crash.client, documents)
            killed(worker_a)
        assert job(crash.client, job_id)["status"] == "running"  # started, then lost
        port = free_port()
        with worker(crash, "b", port):
            done = final(crash.client, job_id)
            assert done["status"] == "succeeded", done
            assert done["upserted"] == len(documents)
            assert present(crash.client, ids) == set(ids)
            drained(crash.env)  # a late duplicate, if any, has run (and counted) by now
            assert completed(port) == {"succeeded": 1.0}
            assert job(crash.client, job_id) == done
        recovered_by_the_dead_worker_check(crash)


@pytest.mark.timeout(300)
def test_a_write_right_after_a_worker_died_mid_write_is_taken_by_another_and_lands(
    shared: Shared,
    tmp_path: Path,
) -> None:
    """Workers A and B both run; whichever takes the ingest dies inside its SQLite write
    transaction, its write lock held. A write into the same index sent right after is taken
    by the other and lands: the lock went with the dead process (nothing waits on it:
    docs/embedded-backend.md). The killed ingest is given back by the dead-worker check and
    lands too, once."""
    marker = {"id": "die-in-write", "text": "die-in-write: a document whose ingest kills"}
    ids = [marker["id"], *(d["id"] for d in KEPT)]
    with (
        crash_stack(shared, tmp_path) as crash,
        worker(crash, "a") as worker_a,
        worker(crash, "b") as worker_b,
    ):
        dying = upsert(crash.client, [marker])
        wait_for(
            lambda: worker_a.poll() is not None or worker_b.poll() is not None,
            "a worker killed in its write transaction",
            120,
        )
        after = final(crash.client, upsert(crash.client, KEPT))
        assert after["status"] == "succeeded", after
        assert after["upserted"] == len(KEPT)
        recovered = final(crash.client, dying)
        assert recovered["status"] == "succeeded", recovered
        assert recovered["upserted"] == 1
        assert present(crash.client, ids) == set(ids)
        assert (worker_a.poll() is None) != (worker_b.poll() is None)  # one died, once


@pytest.mark.timeout(300)
def test_a_delete_whose_worker_was_killed_after_its_commit_reports_what_it_deleted(
    shared: Shared,
    tmp_path: Path,
) -> None:
    ids = [d["id"] for d in KEPT]
    with crash_stack(shared, tmp_path) as crash:
        with worker(crash, "a") as worker_a:
            assert final(crash.client, upsert(crash.client, KEPT))["upserted"] == len(KEPT)
            job_id = delete(crash.client, [*ids[:2], "never-written", "die-after-delete"])
            killed(worker_a)
        port = free_port()
        with worker(crash, "b", port):
            done = final(crash.client, job_id)
            assert done["status"] == "succeeded", done
            assert present(crash.client, ids) == {ids[2]}
            assert done["deleted"] == 2  # what went, though its second run found it gone
            drained(crash.env)
            assert completed(port) == {"succeeded": 1.0}
        recovered_by_the_dead_worker_check(crash)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("by", ["ids", "drop"])
def test_a_delete_accepted_after_a_killed_ingest_wins_whichever_runs_first(
    shared: Shared, tmp_path: Path, by: str
) -> None:
    """By ids or by dropping the index: the ingest's message comes back to worker B with the
    delete's, in whichever order, and nothing of the ingest is left."""
    marker = {"id": "die-embedding", "text": "die-embedding: kills its worker once"}
    documents = [marker, *KEPT]
    ids = [d["id"] for d in documents]
    with crash_stack(shared, tmp_path) as crash:
        with worker(crash, "a") as worker_a:
            ingest_id = upsert(crash.client, documents)
            killed(worker_a)
        # accepted after the ingest, run in any order
        if by == "ids":
            delete_id = delete(crash.client, ids)
        else:
            delete_id = post(crash.client, f"/v1/indexes/{INDEX}", method="DELETE")
        port = free_port()
        with worker(crash, "b", port):
            ingested, deleted = final(crash.client, ingest_id), final(crash.client, delete_id)
            assert ingested["status"] == deleted["status"] == "succeeded"
            assert present(crash.client, ids) == set()
            if by == "drop":
                response = crash.client.get(f"/v1/indexes/{INDEX}", headers=ACME)
                assert response.status_code == 404, response.text
            # the ingest ran first (all written, then all deleted) or second (none written)
            pair = (ingested["upserted"], deleted["deleted"])
            assert pair in ((len(ids), len(ids)), (0, 0)), pair
            drained(crash.env)
            assert completed(port) == {"succeeded": 2.0}
        recovered_by_the_dead_worker_check(crash)


@pytest.mark.timeout(300)
def test_a_drop_whose_worker_was_killed_after_its_commit_reports_what_it_deleted(
    shared: Shared,
    tmp_path: Path,
) -> None:
    index = "die-after-drop"
    ids = [d["id"] for d in KEPT]
    with crash_stack(shared, tmp_path) as crash:
        with worker(crash, "a") as worker_a:
            written = final(crash.client, upsert(crash.client, KEPT, index))
            assert written["upserted"] == len(KEPT)
            job_id = post(crash.client, f"/v1/indexes/{index}", method="DELETE")
            killed(worker_a)
        port = free_port()
        with worker(crash, "b", port):
            done = final(crash.client, job_id)
            assert done["status"] == "succeeded", done
            assert present(crash.client, ids, index) == set()
            assert done["deleted"] == len(KEPT)  # what went, though its rerun found none
            response = crash.client.get(f"/v1/indexes/{index}", headers=ACME)
            assert response.status_code == 404, response.text
            drained(crash.env)
            assert completed(port) == {"succeeded": 1.0}
        recovered_by_the_dead_worker_check(crash)


@pytest.mark.timeout(300)
def test_redis_killed_mid_ingest_the_job_finishes_once(tmp_path: Path) -> None:
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    marker = {"id": "held", "text": "hold-embedding: its embedding waits for the restart"}
    documents = [marker, *KEPT]
    ids = [d["id"] for d in documents]
    port = free_port()
    with FakeAnthropic() as model, broker(tmp_path / "redis") as redis_broker:
        env = stack_env(
            redis_broker.url + "/0",
            model.url,
            SIFT_RUNTIME_FACTORY="tests.reliability.crashing_runtime:build_runtime",
            CRASH_ONCE_DIR=str(crashes),
            SIFT_WORKER_METRICS_PORT=str(port),
        )
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")
        env = child_env(env, inherit_sift=False)
        with (
            worker_process(tmp_path / "w", env) as proc,
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            job_id = upsert(client, documents)
            wait_for(lambda: (crashes / "hold-embedding").exists(), "the ingest embedding")
            assert job(client, job_id)["status"] == "running"
            time.sleep(1.5)  # past appendfsync everysec: the job's start is on disk
            redis_broker.kill(signal.SIGKILL)
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            (crashes / "release").touch()
            done = final(client, job_id)
            assert done["status"] == "succeeded", done
            assert done["upserted"] == len(documents)
            assert present(client, ids) == set(ids)
            drained(env)
            assert completed(port) == {"succeeded": 1.0}
            assert proc.poll() is None  # the same worker, still running


@pytest.mark.timeout(400)
def test_an_ingest_whose_worker_stops_while_it_embeds_is_handed_back_each_time_uncounted(
    shared: Shared, tmp_path: Path
) -> None:
    """Three workers in turn are SIGTERMed while they embed the first chunk of an upsert of
    301 documents (two chunks): each hands the job back at that chunk's end, nothing written,
    and exits at once, cleanly (not cut at its stop deadline); the job reads ``queued``
    again. The stops are not crashes: a fourth worker runs the job once, ``succeeded``, past
    the delivery limit (3) that three cut runs would have reached."""
    marker = {"id": "held", "text": "hold-till-stop: its embedding waits for the stop"}
    documents = [marker, *({"id": f"n{i}", "text": f"calcium note {i}"} for i in range(300))]
    port = free_port()
    with crash_stack(shared, tmp_path) as crash:
        held = crash.directory / "crashes" / "hold-till-stop"
        job_id = ""
        for n in range(3):
            with worker(crash, f"a{n}") as proc:
                job_id = job_id or upsert(crash.client, documents)
                wait_for(held.exists, "the first chunk embedding")
                assert job(crash.client, job_id)["status"] == "running"
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0  # a clean stop: nothing held past its deadline
            assert job(crash.client, job_id)["status"] == "queued"
            held.unlink()  # the next worker's embedding holds too
        held.touch()  # the last runs through
        with worker(crash, "b", port):
            done = final(crash.client, job_id)
            assert done["status"] == "succeeded", done
            assert done["upserted"] == len(documents)
            drained(crash.env)
            assert completed(port) == {"succeeded": 1.0}
            assert present(crash.client, ["held", "n0", "n299"]) == {"held", "n0", "n299"}


@pytest.mark.timeout(300)
def test_an_ingest_restored_by_a_broker_reconnect_while_it_runs_runs_once(
    shared: Shared,
    tmp_path: Path,
) -> None:
    """The worker's broker connections are killed (Redis stays up) while an ingest is being
    embedded: kombu's close puts the running task's message back, and the worker takes it
    again while the first run goes on. The copy must leave the job to that run (its run
    claim): not start it again (its ``started_at`` rewritten), not write or finish it."""
    marker = {"id": "held", "text": "hold-embedding: its embedding waits for the copy"}
    documents = [marker, *KEPT]
    ids = [d["id"] for d in documents]
    with (
        crash_stack(shared, tmp_path) as crash,
        redis.Redis.from_url(crash.env["SIFT_REDIS_URL"]) as raw,
    ):
        port = free_port()
        with worker(crash, "a", port) as proc:
            job_id = upsert(crash.client, documents)
            wait_for(lambda: (crash.directory / "crashes" / "hold-embedding").exists(), "held")
            started = job(crash.client, job_id)
            assert started["status"] == "running", started
            log = crash.directory / "w" / "a.log"
            raw.client_kill_filter(_type="normal", skipme=True)  # the worker's too
            wait_for(
                lambda: (
                    not raw.llen(INGEST_QUEUE)
                    and not raw.hlen(KOMBU_UNACKED_KEY)  # the copy taken and acked (its tag)
                    and (
                        "another run holds it" in log.read_text(errors="replace")
                        or job(crash.client, job_id)["status"] != "running"
                    )
                ),
                "the copy delivered and done",
            )
            meanwhile = job(crash.client, job_id)
            (crash.directory / "crashes" / "release").touch()
            done = final(crash.client, job_id)
            drained(crash.env)
            counted = completed(port)
            written = present(crash.client, ids)
            assert proc.poll() is None  # the same worker, still running
    assert meanwhile == started, (meanwhile, started)  # the copy wrote nothing
    assert done["status"] == "succeeded" and done["upserted"] == len(documents), done
    assert done["started_at"] == started["started_at"], (done, started)
    assert counted == {"succeeded": 1.0}
    assert written == set(ids)
