"""Hosts whose wall clocks disagree: a worker or gateway minutes off the others keeps every
time another host reads on Redis's clock.

Each test starts real processes under libfaketime (``LD_PRELOAD``; ``apt-get install
faketime``), which moves their wall clock and leaves their monotonic clock alone, as a host
with a misconfigured NTP has. Redis, the receiver and the test keep the true time. Before:
a worker 6 minutes ahead or behind signed its webhooks with its own clock, and a Standard
Webhooks receiver (5 minutes of tolerance) refused each one, which Sift settled ``failed``
after one attempt; a retry scheduled by a worker 3 minutes ahead was held back 3 minutes on
every other worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from standardwebhooks.webhooks import Webhook

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    KEYS,
    answered_once,
    ingest,
    sample_queries,
    serve_hook,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, free_port, gateway, http_get, redis_server
from worker.clock import server_seconds
from worker.constants import (
    DELIVERY_OWNERS_KEY,
    INGEST_QUEUE,
    KOMBU_UNACKED_INDEX_KEY,
    KOMBU_UNACKED_KEY,
    WEBHOOK_QUEUE,
    WEBHOOKS_OWED_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.constants import METRIC_CLOCK_SKEW as SKEW
from worker.contract import SearchSpec
from worker.processes.stack import child_env, stop, worker_service
from worker.queue.config import visibility_timeout
from worker.queue.jobstore import JobStore
from worker.settings import load_settings
from worker.webhooks.delivery import JITTER, RETRY_SCHEDULE_SECONDS

pytestmark = pytest.mark.integration

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
if not FAKETIME.exists():  # pragma: no cover
    pytest.skip("libfaketime is not installed (apt-get install faketime)", allow_module_level=True)


def skewed(env: dict[str, str], skew: str) -> dict[str, str]:
    """``env`` for a process whose wall clock reads ``skew`` off (libfaketime's ``+6m``,
    ``-3m``...), its monotonic clock true. libfaketime reads its settings from the
    environment once (``FAKETIME_CACHE_DURATION``; by default again every 10 s, from whichever
    thread reads the time): about one skewed worker start in 12 died of SIGSEGV in libc's
    ``getenv`` (the kernel's log) right after its clock warning, "exited early" without a
    word, most likely that re-read racing a ``setenv`` in another thread."""
    return {
        **env,
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": skew,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_CACHE_DURATION": str(10**9),
    }


@contextlib.contextmanager
def skewed_worker(
    tmp: Path, env: dict[str, str], skew: str, name: str, **options: Any
) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`celery_worker` on a clock ``skew`` off (:func:`skewed`), started again when
    libfaketime kills its start (SIGSEGV before it is ready: the race :func:`skewed`
    describes, still met now and then by a clean-clone CI), at most three
    tries: a crash of the clock's shim at the start, not of Sift."""
    for attempt in range(1, 4):
        stack = contextlib.ExitStack()
        try:
            worker = stack.enter_context(celery_worker(tmp, skewed(env, skew), name, **options))
        except RuntimeError as exc:
            stack.close()
            if "killed by SIGSEGV" in str(exc) and attempt < 3:
                continue
            raise
        with stack:
            yield worker
        return


class VerifyingReceiver:
    """A Standard Webhooks receiver: verifies each POST with the ``standardwebhooks``
    library (its 5 minutes of tolerance against this, the true, clock) and answers 400 to
    one it refuses, 204 to one it accepts; or 503 to its first ``failures`` POSTs."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.answers: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.url = ""

    def serve(self) -> Iterator[VerifyingReceiver]:
        receiver = self
        verifier = Webhook(KEYS[0]["webhook_secret"])

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    verifier.verify(body, headers)
                    code, why = 204, "verified"
                except Exception as exc:  # what a receiver's library refuses, it refuses
                    code, why = 400, f"{type(exc).__name__}: {exc}"
                with receiver.lock:
                    if len(receiver.answers) < receiver.failures:
                        code = 503
                    receiver.answers.append((code, why))
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        with serve_hook(Handler) as self.url:
            yield self

    def seen(self) -> list[tuple[int, str]]:
        with self.lock:
            return list(self.answers)


@pytest.fixture
def verifying() -> Iterator[VerifyingReceiver]:
    yield from VerifyingReceiver().serve()


@pytest.fixture
def failing_once() -> Iterator[VerifyingReceiver]:
    yield from VerifyingReceiver(failures=1).serve()


def _webhook(client: httpx.Client, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = client.get(f"/v1/searches/{job_id}", headers=ACME).json()
    return job.get("webhook") or {}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("skew", ["+6m", "-6m"])
def test_a_worker_minutes_off_signs_webhooks_a_receiver_accepts(
    tmp_path: Path, model: FakeAnthropic, verifying: VerifyingReceiver, skew: str
) -> None:
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url)
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            skewed_worker(tmp_path / "w", env, skew, "skewed"),
        ):
            ingest(client)
            job_id = submit_search(client, sample_queries()[0], webhook_url=verifying.url)
            wait_for(
                lambda: _webhook(client, job_id).get("status") not in (None, "pending", "retrying"),
                "the webhook settled",
            )
            webhook = _webhook(client, job_id)
    assert verifying.seen() == [(204, "verified")]
    assert webhook == {"status": "delivered", "attempts": 1}


@pytest.mark.timeout(240)
def test_a_retry_scheduled_by_a_worker_ahead_is_due_on_the_shared_clock(
    tmp_path: Path, model: FakeAnthropic, failing_once: VerifyingReceiver
) -> None:
    """Attempt 1 (answered 503) is made by a worker 3 minutes ahead, which then stops (a
    rolling restart); a worker with a true clock makes attempt 2, the schedule's wait (5 s
    at the defaults, give or take the jitter) after attempt 1 on Redis's clock. Its due time
    (the task's ``due_at``, and the ETA of its message, which Celery wrote on the sender's
    clock and waited for on the receiver's) read 3 minutes more, and the other worker
    waited them out, past the 90 s this test waits."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, SIFT_WEBHOOK_RETRY_SCALE="1")
        shared = redis.Redis.from_url(url + "/0")
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            with skewed_worker(tmp_path / "w1", env, "+3m", "ahead"):
                ingest(client)
                job_id = submit_search(client, sample_queries()[0], webhook_url=failing_once.url)
                wait_for(lambda: _webhook(client, job_id).get("status") == "retrying", "attempt 1")
                answered = server_seconds(shared.time())  # just after attempt 1's answer
                due = shared.zscore(WEBHOOKS_OWED_KEY, job_id)  # when the re-drive expects it
            with celery_worker(tmp_path / "w2", env, "true"):
                wait_for(
                    lambda: _webhook(client, job_id).get("status") == "delivered",
                    "attempt 2, made by the worker with a true clock",
                )
        shared.close()
    assert [code for code, _ in failing_once.seen()] == [503, 204]
    # the re-drive's due time too (a retry only moves it later: it was the job's end, on
    # the worker's own clock, 3 minutes ahead)
    assert due is not None and due - answered <= RETRY_SCHEDULE_SECONDS[1] * (1 + JITTER)


def _times(job: dict[str, Any]) -> list[datetime]:
    return [datetime.fromisoformat(job[k]) for k in ("created_at", "started_at", "finished_at")]


@pytest.mark.timeout(240)
def test_jobs_are_timed_and_listed_on_one_clock_across_hosts(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """Two gateways share one Redis, one 6 minutes ahead; the worker runs 6 minutes behind.
    A search submitted on the gateway ahead, then one on the true gateway, list newest first
    (the second first), and each was created, started and finished in that order. Before,
    ``created_at`` was the gateway's own clock and ``started_at``/``finished_at`` the
    worker's: the first search listed as the newer, started 12 minutes before it was
    created, and a client paging until the first id it had seen never saw the second."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url)
        with (
            gateway(tmp_path / "g1", skewed(env, "+6m"), "ahead") as ahead,
            gateway(tmp_path / "g2", env, "true") as true,
            httpx.Client(base_url=ahead, timeout=30) as first_client,
            httpx.Client(base_url=true, timeout=30) as client,
            skewed_worker(tmp_path / "w", env, "-6m", "behind"),
        ):
            ingest(client)
            answered_once(client, model)  # the deployment's first answer: listed last
            first = submit_search(first_client, sample_queries()[0])
            second = submit_search(client, sample_queries()[1])
            listed = client.get("/v1/searches", headers=ACME).json()["searches"]
            wait_for(
                lambda: all(
                    client.get(f"/v1/searches/{j}", headers=ACME).json()["status"] == "succeeded"
                    for j in (first, second)
                ),
                "both searches succeeded",
            )
            jobs = [client.get(f"/v1/searches/{j}", headers=ACME).json() for j in (first, second)]
    assert [s["id"] for s in listed][:2] == [second, first] and len(listed) == 3
    assert listed[0]["created_at"] >= listed[1]["created_at"]
    for job in jobs:
        created, started, finished = _times(job)
        assert created <= started <= finished, job


def _skew_warnings(log: str) -> list[float]:
    """The skews the clock's warnings in ``log`` name (``worker/clock.py`` prints them to a
    tenth of a second: 6 minutes ahead, measured over a round trip, reads +359.9 or +360.0)."""
    return [float(s) for s in re.findall(r"this host's clock is ([+-][0-9.]+) s off", log)]


def _gauge(url: str, name: str) -> float | None:
    for family in text_string_to_metric_families(http_get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


@pytest.mark.timeout(120)
def test_each_host_measures_its_clock_against_the_shared_one(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """``sift_clock_skew_seconds`` on a worker 6 minutes ahead and on a gateway 6 minutes
    behind, and the worker's warning, once. Before, nothing measured a host's clock: the
    skews above showed only as their harm."""
    port = free_port()
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url)
        with (
            gateway(tmp_path / "g", skewed(env, "-6m")) as base,
            skewed_worker(
                tmp_path / "w", {**env, "SIFT_WORKER_METRICS_PORT": str(port)}, "+6m", "w"
            ),
        ):
            worker_metrics = f"http://127.0.0.1:{port}/metrics"
            wait_for(lambda: _gauge(worker_metrics, SKEW) not in (None, 0.0), "the worker's skew")
            worker = _gauge(worker_metrics, SKEW)
            gateway_skew = _gauge(base + "/metrics", SKEW)
        log = (tmp_path / "w" / "w.log").read_text()
    assert worker is not None and abs(worker - 360) < 5
    assert gateway_skew is not None and abs(gateway_skew + 360) < 5
    warned = _skew_warnings(log)
    assert len(warned) == 1 and abs(warned[0] - 360) < 5, log


def _delivery(tag: str, queue: str) -> str:
    """An ``unacked`` entry as kombu's Redis transport writes it (``[message, exchange,
    routing key]``), of a message on ``queue`` by the anonymous exchange."""
    message = {
        "body": "",
        "headers": {"id": tag},
        "properties": {"delivery_tag": tag, "delivery_info": {}, "priority": 0},
    }
    return json.dumps([message, "", queue])


@pytest.mark.timeout(180)
def test_a_worker_ahead_puts_back_no_delivery_taken_within_the_visibility_timeout(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """A worker 30 minutes ahead, past the visibility timeout (1,600 s at the defaults),
    joins workers that hold deliveries. It puts back the ones taken long ago: one taken
    past the visibility timeout (kombu's sweep) and one no worker recorded as its own,
    taken past ``SIFT_WORKER_ORPHAN_DELIVERY_SECONDS`` (Sift's dead-worker check). It keeps
    those just taken: one a live worker holds, one whose owner's record is still on its
    way. Before, both read the take times (``unacked_index``, Redis's clock) against the
    worker's own: everything taken in the last 30 minutes looked overdue, a live worker's
    message was run a second time. The deliveries are on the webhooks queue, which this
    worker does not consume, so what it puts back stays there to be seen."""
    queue = WEBHOOK_QUEUE
    with redis_server(tmp_path / "redis") as url:
        shared = redis.Redis.from_url(url + "/0", decode_responses=True)
        now = server_seconds(shared.time())
        visibility = visibility_timeout(load_settings(redis_url=url + "/0"))
        orphaned = load_settings(redis_url=url + "/0").worker_orphan_delivery_seconds
        taken = {
            "overdue": now - visibility - 10,  # a dead worker's, past the visibility timeout
            "held": now,  # the live worker's
            "orphaned": now - orphaned - 10,  # nobody's, past the orphan window
            "unrecorded": now,  # its owner's record still on its way
        }
        shared.set(WORKER_HEARTBEAT_KEY + "live@host", "1", px=600_000)
        shared.hset(DELIVERY_OWNERS_KEY, mapping={"overdue": "live@host", "held": "live@host"})
        shared.hset(KOMBU_UNACKED_KEY, mapping={t: _delivery(t, queue) for t in taken})
        shared.zadd(KOMBU_UNACKED_INDEX_KEY, taken)

        def put_back() -> set[str]:
            return {json.loads(m)["headers"]["id"] for m in shared.lrange(queue, 0, -1)}

        env = stack_env(url + "/0", model.url)
        with skewed_worker(tmp_path / "w", env, "+30m", "ahead", queues=INGEST_QUEUE):
            wait_for(lambda: {"overdue", "orphaned"} <= put_back(), "the overdue put back")
            back = put_back()
            left = set(shared.hkeys(KOMBU_UNACKED_KEY))
        shared.close()
    assert back == {"overdue", "orphaned"}
    assert left == {"held", "unrecorded"}


@pytest.mark.timeout(240)
def test_a_worker_behind_records_its_deliveries_taken_on_the_shared_clock(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """A worker 30 minutes behind takes a search (held at the model): kombu records when it
    took it (``unacked_index``), which every other worker's sweep reads against Redis's
    clock. It is recorded on that clock. Before, it was the worker's own, 30 minutes in the
    past, past the visibility timeout: every other worker's next sweep put the message back
    while the search ran, and it ran twice."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url)
        shared = redis.Redis.from_url(url + "/0", decode_responses=True)
        model.configure(hold_unscripted=True)
        try:
            with (
                gateway(tmp_path / "g", env) as base,
                httpx.Client(base_url=base, timeout=30) as client,
                skewed_worker(tmp_path / "w", env, "-30m", "behind"),
            ):
                ingest(client)
                received = model.counts()["received"]
                before = server_seconds(shared.time())
                submit_search(client, sample_queries()[0])
                wait_for(lambda: model.counts()["received"] > received, "the search at the model")
                after = server_seconds(shared.time())
                taken = [score for _, score in shared.zrange(KOMBU_UNACKED_INDEX_KEY, 0, -1,
                                                             withscores=True)]  # fmt: skip
        finally:
            model.configure(hold_unscripted=False)
        shared.close()
    assert taken and all(before - 1 <= t <= after + 1 for t in taken), (before, taken, after)


@pytest.mark.timeout(120)
def test_sift_status_on_a_host_minutes_off_shows_the_ages_on_the_shared_clock(
    tmp_path: Path, model: FakeAnthropic
) -> None:
    """``sift status`` run on a host 6 minutes behind, of a worker 6 minutes ahead and a
    batch created on the shared clock: the worker's heartbeat age, the batch's age and the
    age of a webhook owed since 10 minutes ago are the time since, on Redis's clock (each
    between what Redis read before the command ran and after). Before, the command measured
    them on its host's clock, and the worker wrote its heartbeat on its own: the batch was -6
    minutes old and the heartbeat -12."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url)
        store = JobStore.from_url(url + "/0")
        batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q"))])
        store.start_item(batch.id, "q0")
        shared = store.redis
        stuck = server_seconds(shared.time()) - 600  # a webhook owed, due 10 minutes ago
        shared.zadd(WEBHOOKS_OWED_KEY, {"srch_stuck": stuck})
        with skewed_worker(tmp_path / "w", env, "+6m", "ahead"):
            wait_for(lambda: bool(list(shared.scan_iter(WORKER_HEARTBEAT_KEY + "*"))), "a beat")
            [beat_key] = list(shared.scan_iter(WORKER_HEARTBEAT_KEY + "*"))
            beat_before, read_from = float(shared.get(beat_key) or 0), server_seconds(shared.time())
            run = subprocess.run(
                [sys.executable, "-m", "worker.cli", "status", "--json", "--no-inspect"],
                env=skewed({**os.environ, "SIFT_REDIS_URL": url + "/0"}, "-6m"),
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            read_by, beat_after = server_seconds(shared.time()), float(shared.get(beat_key) or 0)
        store.close()
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    [worker] = status["workers"]
    [shown] = status["batches"]
    # one of the beats seen around the run, when it ran; the worker's reading of the shared
    # clock is off by up to half a round trip (tenths of a second on a loaded machine)
    age = worker["beat_age_seconds"]
    assert read_from - beat_after - 1 <= age <= read_by - beat_before + 1, age
    age = shown["age_seconds"]
    assert read_from - batch.created_at - 0.1 <= age <= read_by - batch.created_at + 0.1, age
    age = status["webhooks"]["oldest_overdue_seconds"]
    assert read_from - stuck - 0.1 <= age <= read_by - stuck + 0.1, age


@pytest.mark.timeout(240)
def test_a_prefork_worker_started_before_redis_signs_webhooks_on_the_shared_clock(
    tmp_path: Path, model: FakeAnthropic, verifying: VerifyingReceiver
) -> None:
    """A ``--pool prefork`` worker 6 minutes ahead starts while Redis is not up yet (a
    deployment that starts the workers first): it cannot read Redis's clock as it starts.
    Redis comes up; a search's webhook, run in a pool's child, is signed on the shared clock,
    and the receiver accepts it. Before, the pool's children were forked while the consumer
    still tried to connect, and only the parent's heartbeat read the clock: the children kept
    their host's for as long as they lived, and the webhook was refused (400), settled
    ``failed``. (``sift worker`` now waits for Redis before it starts Celery's worker, the
    fork among it; the webhook must be signed on the shared clock all the same.)"""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    env = stack_env(url, model.url)
    # its monotonic clock moved by as much (one offset, so each interval is true): kombu's
    # connection retries sleep, and libfaketime fails a sleep (EINVAL) when it fakes only
    # the wall clock
    ahead = {**skewed(env, "+6m"), "FAKETIME_DONT_FAKE_MONOTONIC": "0"}
    service = worker_service(
        tmp_path / "w", child_env(ahead, inherit_sift=False), "ahead",
        concurrency=2, pool="prefork",
    )  # fmt: skip
    log = tmp_path / "w" / "ahead.log"
    service.start()
    assert service.proc is not None
    try:
        wait_for(lambda: "waiting: cannot connect" in log.read_text(errors="replace"), "waiting")
        with redis_server(tmp_path / "redis", port=port):
            service.wait_ready()
            with (
                gateway(tmp_path / "g", env) as base,
                httpx.Client(base_url=base, timeout=30) as client,
            ):
                ingest(client)
                job_id = submit_search(client, sample_queries()[0], webhook_url=verifying.url)
                wait_for(
                    lambda: (
                        _webhook(client, job_id).get("status") not in (None, "pending", "retrying")
                    ),
                    "the webhook settled",
                )
                webhook = _webhook(client, job_id)
    finally:
        stop(service.proc, service.stop_timeout)
    assert verifying.seen() == [(204, "verified")]
    assert webhook == {"status": "delivered", "attempts": 1}
