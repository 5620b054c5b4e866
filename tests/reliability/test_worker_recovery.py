"""A dead worker's batch comes back in seconds, at default settings, with one result per item.

Each test runs a real stack (redis-server, the gateway under uvicorn, ``sift worker``
processes on the threads pool, the fake Messages API answering in 0.3 s) with
every ``SIFT_`` setting that matters here at its default: the broker's visibility timeout
(about 27 minutes), the heartbeat (2 s, dead after 10 s), the worker's 300 threads, the
chunk size. Only the things a test cannot run without are set: the Redis URL, the keys, the
model's address, and no metrics port (several workers on one machine).

- kill -9 of the only worker mid-batch, then a new worker: the batch finishes within
  :data:`RECOVERY_WINDOW` of the new worker's start (the design figure is about 20 s; the
  window is over 3x that), every item succeeded once, only the items the dead worker
  had running were sent to the model twice, and the ``batch.completed`` webhook arrives
  with ``webhook-id: msg_<batch id>`` on every try;
- a slow healthy worker (every model call takes longer than the heartbeat's TTL) never has
  its work taken back: every item is sent to the model exactly once;
- SIGTERM (a rolling restart) hands the batch back at once: the stopping worker exits within
  3x the soft-shutdown window, leaves no item ``running``, and another worker finishes the
  batch with every item sent to the model exactly once; under the shared rate budget too,
  the items waiting for it going back at once (not held to the stop deadline, not counted
  lost), and those waiting for a place among the process's model calls in flight; a stop
  that model calls do hold to its deadline names them in its line; on the ``solo`` pool
  too, no retry of a 429 sent by the stopping worker.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import redis

from tests import fake_anthropic as fa
from tests.fake_anthropic import FakeAnthropic
from tests.integration.slow_receivers import slow_receiver
from tests.reliability.economy import worker_log
from tests.reliability.support import (
    ACME,
    FINISH_TIMEOUT,
    INDEX,
    Receiver,
    all_results,
    answered_once,
    assert_batch_exactly_once,
    batch_counts,
    broker_state,
    ingest,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import gateway, redis_server
from worker.adapters.rate_budget import BURST_FRACTION
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_ITEMS_KEY,
    BATCH_LOST_KEY,
    BATCH_QUEUE,
    BATCH_RUNS_KEY,
    DELIVERY_OWNERS_KEY,
    KOMBU_UNACKED_KEY,
    RATE_BUDGET_KEY,
    SEARCH_KEY,
    SEARCH_TASK,
)
from worker.processes.stack import child_env, worker_process
from worker.processes.workers import STOP_DEADLINE_STATUS, STOP_GRACE_SECONDS
from worker.settings import Settings

pytestmark = pytest.mark.integration

TOTAL = 1_000
MODEL_SECONDS = 0.3
RECOVERY_WINDOW = 180.0  # seconds from the new worker's start to the batch finished
ITEM = re.compile(r"item (q\d{5})")


@pytest.fixture(scope="module")
def model() -> Iterator[FakeAnthropic]:
    """The fake model, answering in 0.3 s (as the issue's reproduction)."""
    with FakeAnthropic(delay=MODEL_SECONDS) as fake:
        yield fake


def default_env(redis_url: str, model_url: str) -> dict[str, str]:
    """The stack's environment with every recovery-related setting at its default."""
    env = stack_env(redis_url, model_url)
    env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # back to its default (10 s)
    return env


class RecoveryStack(NamedTuple):
    url: str  # the Redis database the stack uses
    env: dict[str, str]  # the environment of its processes
    client: httpx.Client  # a client of its gateway


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory, model: FakeAnthropic
) -> Iterator[RecoveryStack]:
    """redis-server and the gateway at default settings, and a client of the gateway, for
    every test of the module (:func:`recovery_stack` empties them between tests): each test
    starts (and kills) its own workers (a gateway of its own took 1 to 4 s of each test)."""
    tmp = tmp_path_factory.mktemp("recovery")
    with redis_server(tmp / "redis") as base_url:
        url = base_url + "/0"
        env = default_env(url, model.url)
        with (
            gateway(tmp / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            yield RecoveryStack(url, env, client)


@contextmanager
def recovery_stack(shared: RecoveryStack) -> Iterator[RecoveryStack]:
    """The module's stack as a test of its own finds it: the Redis database emptied (no job,
    message, worker record or budget of an earlier test), and its workers' environment with
    a data folder of their own (no index an earlier test's workers wrote)."""
    flushed = redis.Redis.from_url(shared.url)
    try:
        flushed.flushdb()
    finally:
        flushed.close()
    yield shared._replace(env=default_env(shared.url, shared.env["ANTHROPIC_BASE_URL"]))


@contextmanager
def worker(
    directory: Path,
    env: dict[str, str],
    name: str,
    processes: int = 1,
    pool: str | None = None,
    concurrency: int | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """``sift worker`` at its default concurrency and pool unless given (``processes``: its
    supervisor's Celery processes, one per core at the defaults)."""
    env = child_env(env, inherit_sift=False)
    with worker_process(
        directory, env, name, processes=processes, pool=pool, concurrency=concurrency
    ) as proc:
        yield proc


def submit(client: httpx.Client, n: int, webhook_url: str | None = None, first: int = 0) -> str:
    """A batch whose every query names its item, so the model's requests say which item
    each one is for (``first``: the number of its first item's id)."""
    queries = sample_queries()
    body: dict[str, Any] = {
        "index": INDEX,
        "rerank": True,
        "queries": [
            {"id": f"q{i:05d}", "query": f"{queries[i % len(queries)]} item q{i:05d}"}
            for i in range(first, first + n)
        ],
    }
    if webhook_url:
        body["webhook_url"] = webhook_url
    response = client.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


STOP_BEGINS = "SIGTERM: stopping"  # the supervisor's line, written before its children's stop
WARM_SHUTDOWN = "worker: Warm shutdown"  # each Celery process's, as its stop begins
TASK_RECEIVED = re.compile(r"Task (\S+)\[([0-9a-f-]+)\] received")


def tasks_received(log: str) -> list[str]:
    """The tasks (``name[id]``) a ``sift worker`` log shows received, in order."""
    return [f"{m[1]}[{m[2]}]" for m in TASK_RECEIVED.finditer(log)]


def model_calls(fake: FakeAnthropic) -> Counter[str]:
    """How many times the model was asked about each item."""
    calls: Counter[str] = Counter()
    for request in fake.requests():
        text = str(request["body"].get("messages", ""))
        calls.update(set(ITEM.findall(text)))
    return calls


def item_statuses(redis_url: str, batch_id: str) -> dict[str, str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return dict(client.hgetall(BATCH_ITEMS_KEY + batch_id))
    finally:
        client.close()


def owner_records(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return int(client.hlen(DELIVERY_OWNERS_KEY))
    finally:
        client.close()


def succeeded(client: httpx.Client, batch_id: str) -> int:
    return int(batch_counts(client, batch_id)["counts"]["succeeded"])


def finished(client: httpx.Client, batch_id: str) -> bool:
    return batch_counts(client, batch_id)["status"] == "succeeded"


def wait_finished(client: httpx.Client, url: str, batch_id: str, timeout: float) -> None:
    try:
        wait_for(lambda: finished(client, batch_id), "the batch finished", timeout)
    except AssertionError as exc:
        counts = batch_counts(client, batch_id)["counts"]
        raise AssertionError(f"{exc}; {counts}; {broker_state(url)}") from exc


def assert_no_run_lost(url: str, batch_id: str) -> None:
    """A clean hand-back is no lost run: nothing counts toward the poison limit."""
    lost = redis.Redis.from_url(url, decode_responses=True)
    try:
        assert lost.hgetall(BATCH_LOST_KEY + batch_id) == {}
    finally:
        lost.close()


def finished_once_by_another_worker(
    tmp_path: Path,
    stack: RecoveryStack,
    model: FakeAnthropic,
    batch_id: str,
    total: int,
) -> None:
    """A second worker finishes the batch a stopped one handed back: every item once, each
    sent to the model once, no run counted lost."""
    url, env, client = stack
    with worker(tmp_path / "w", env, "b"):
        wait_finished(client, url, batch_id, RECOVERY_WINDOW)
    assert_batch_exactly_once(client, url, batch_id, total)
    assert model_calls(model) == Counter({f"q{i:05d}": 1 for i in range(total)})
    assert_no_run_lost(url, batch_id)


def test_the_defaults_are_what_this_file_claims() -> None:
    """The figures the tests and the docs rely on are the defaults."""
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.broker_visibility_timeout_seconds is None
    assert settings.worker_heartbeat_seconds == 2.0
    assert settings.worker_dead_after_seconds == 10.0
    assert settings.worker_soft_shutdown_seconds == 10.0


@pytest.mark.timeout(420)
def test_a_killed_worker_s_batch_finishes_on_a_new_worker_within_the_window(
    tmp_path: Path, model: FakeAnthropic, shared: RecoveryStack, receiver: Receiver
) -> None:
    model.reset()
    with recovery_stack(shared) as (url, env, client):
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit(client, TOTAL, webhook_url=receiver.url)
            wait_for(lambda: succeeded(client, batch_id) >= 100, "100 items done on A")
            worker_a.send_signal(signal.SIGKILL)
            worker_a.wait(10)
        statuses = item_statuses(url, batch_id)
        running_at_kill = {q for q, s in statuses.items() if s == "running"}
        done_at_kill = sum(1 for s in statuses.values() if s == "succeeded")
        print(f"\nworker A killed: {done_at_kill} succeeded, {len(running_at_kill)} running")
        assert done_at_kill < TOTAL, "the batch finished before the kill"
        started = time.monotonic()
        with worker(tmp_path / "w", env, "b"):
            wait_finished(client, url, batch_id, RECOVERY_WINDOW)
            recovered = time.monotonic() - started
            wait_for(lambda: bool(receiver.for_job(batch_id)), "the batch webhook", 30)
            time.sleep(1.0)  # a late duplicate, if any, lands now
        print(f"recovered: the batch finished {recovered:.1f}s after worker B started")
        # by the dead-worker check, not by the broker's visibility timeout
        assert "of dead worker" in (tmp_path / "w" / "b.log").read_text(errors="replace")
        assert_batch_exactly_once(client, url, batch_id, TOTAL)
        calls = model_calls(model)
        assert set(calls) == {f"q{i:05d}" for i in range(TOTAL)}
        twice = {q for q, n in calls.items() if n > 1}
        print(f"items sent to the model twice: {len(twice)} (running at the kill)")
        assert twice <= running_at_kill, sorted(twice - running_at_kill)[:5]
        assert max(calls.values()) <= 2
        # the batch.completed webhook (at least once: a retry is allowed) under one webhook-id
        deliveries = receiver.for_job(batch_id)
        assert {d.headers["webhook-id"] for d in deliveries} == {f"msg_{batch_id}"}
        assert {d.body["type"] for d in deliveries} == {"batch.completed"}
        print(f"batch webhook delivered {len(deliveries)} time(s)")


@pytest.mark.timeout(300)
def test_a_slow_healthy_worker_is_never_run_twice(
    tmp_path: Path, model: FakeAnthropic, shared: RecoveryStack
) -> None:
    """Each model call takes 15 s, longer than a heartbeat's TTL (10 s) and several checks
    for dead workers (every 2 s): two live workers share a batch and no item's model call
    happens twice."""
    n = 100
    model.reset()
    model.configure(delay=15.0)
    try:
        with (
            recovery_stack(shared) as (url, env, client),
            worker(tmp_path / "w", env, "a"),
            worker(tmp_path / "w", env, "b"),
        ):
            ingest(client)
            batch_id = submit(client, n)
            wait_finished(client, url, batch_id, 120)
            time.sleep(3.0)  # a needless restore would have run by now
            assert_batch_exactly_once(client, url, batch_id, n)
            # every acked delivery's record was dropped again: nothing leaks
            assert owner_records(url) == 0
        calls = model_calls(model)
        assert calls == Counter({f"q{i:05d}": 1 for i in range(n)})
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "w").glob("*.log"))
        assert "put back on their queues" not in logs
    finally:
        model.configure(delay=MODEL_SECONDS)


@pytest.mark.timeout(300)
def test_sigterm_hands_the_batch_back_and_another_worker_finishes_it_once(
    tmp_path: Path, model: FakeAnthropic, shared: RecoveryStack
) -> None:
    model.reset()
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with recovery_stack(shared) as (url, env, client):
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit(client, TOTAL)
            wait_for(lambda: succeeded(client, batch_id) >= 100, "100 items done on A")
            stopping = time.monotonic()
            worker_a.send_signal(signal.SIGTERM)
            worker_a.wait(3 * soft_shutdown)
            exited = time.monotonic() - stopping
        statuses = Counter(item_statuses(url, batch_id).values())
        state = broker_state(url)
        print(f"\nworker A exited {exited:.1f}s after SIGTERM: items {dict(statuses)}; {state}")
        assert statuses["succeeded"] < TOTAL, "the batch finished before the SIGTERM"
        # every item A started finished there; the rest went back, not stranded running
        assert set(statuses) <= {"queued", "succeeded"}, statuses
        assert state[BATCH_QUEUE] > 0 and state[KOMBU_UNACKED_KEY] == 0, state
        with worker(tmp_path / "w", env, "b"):
            wait_finished(client, url, batch_id, RECOVERY_WINDOW)
            time.sleep(1.0)
        assert_batch_exactly_once(client, url, batch_id, TOTAL)
        calls = model_calls(model)
        assert calls == Counter({f"q{i:05d}": 1 for i in range(TOTAL)})
    # a hand-back is a clean stop: one INFO line a message, no warning with a traceback
    log = (tmp_path / "w" / "a.log").read_text(errors="replace")
    assert "handed back" in log
    assert "Traceback" not in log and " WARNING " not in log, log[-3000:]


@pytest.mark.timeout(300)
def test_sigterm_hands_back_the_items_waiting_for_the_rate_budget(
    tmp_path: Path, shared: RecoveryStack
) -> None:
    """SIGTERM while the shared rate budget paces a batch (``SIFT_RATE_LIMITS`` at the
    provider's limit, the fake metering the same): the items waiting for the budget (in
    their pacing, for their reservation) stop waiting and go back with the chunk, so the
    warm shutdown ends at once. Before, they waited on through the stop deadline, the
    process exited as after a crash (``not stopped ... exiting now``), and their runs came
    back through the dead-worker check: counted lost toward the poison limit, and those
    already past their model call's reservation sent to the model twice."""
    rpm = 30  # the budget's burst (90%) runs at once; the rest waits, a call every 2 s
    total = 40
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with (
        FakeAnthropic(delay=MODEL_SECONDS, rpm=rpm) as model,
        recovery_stack(shared) as (url, env, client),
    ):
        env = {
            **env,
            "ANTHROPIC_BASE_URL": model.url,
            "SIFT_RATE_LIMITS": json.dumps({"claude-haiku-4-5": {"rpm": rpm}}),
        }
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit(client, total)
            burst = int(rpm * BURST_FRACTION)
            wait_for(lambda: succeeded(client, batch_id) >= burst, "the budget's burst done")
            waiting = batch_counts(client, batch_id)["counts"]
            assert model.counts()["received"] < total and waiting["running"] > 0, waiting
            worker_a.send_signal(signal.SIGTERM)
            code = worker_a.wait(3 * soft_shutdown)
        log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        assert "not stopped" not in log and code == 0, (code, log[-2000:])
        statuses = Counter(item_statuses(url, batch_id).values())
        assert set(statuses) <= {"queued", "succeeded"}, statuses  # none left running
        assert statuses["queued"] > 0, statuses
        finished_once_by_another_worker(tmp_path, RecoveryStack(url, env, client), model,
                                        batch_id, total)  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_sigterm_hands_back_the_items_waiting_for_a_place_in_flight(
    tmp_path: Path, shared: RecoveryStack, pool: str
) -> None:
    """SIGTERM while 2 items of a batch of 10 are in their model calls, which the model
    holds, and 8 wait for one of the process's places in flight (``SIFT_RERANK_MAX_IN_FLIGHT``
    at 2): the 8 stop waiting and go back ``queued`` before any place frees, unsent; once the
    model answers the 2, the worker exits cleanly, and another worker finishes the 8: every
    item sent to the model once, no run counted lost. The calls' timeout and the search
    deadline are a minute here, so no place frees until the model answers. On ``--pool
    prefork`` (one child) the SIGTERM reaches the child running the chunk, which holds the
    items (Celery's warm shutdown tells a child nothing: the parent signals it)."""
    total, places = 10, 2
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    options: dict[str, Any] = {"pool": "prefork", "concurrency": 1} if pool == "prefork" else {}
    with FakeAnthropic() as model, recovery_stack(shared) as (url, env, client):
        env = {
            **env,
            "ANTHROPIC_BASE_URL": model.url,
            "SIFT_RERANK_MAX_IN_FLIGHT": str(places),
            # the held calls outlast the test's waits, so no place frees until they are answered
            "SIFT_GENERATION_TIMEOUT_SECONDS": "60",
            "SIFT_SEARCH_DEADLINE_SECONDS": "60",
        }
        with worker(tmp_path / "w", env, "a", **options) as worker_a:
            ingest(client)
            answered_once(client, model)  # the deployment's first answer, before the hold
            model.configure(hold_unscripted=True)  # the calls in flight held, unanswered
            batch_id = submit(client, total)
            wait_for(lambda: model.counts()["received"] == places, "two calls at the model")
            wait_for(
                lambda: batch_counts(client, batch_id)["counts"]["running"] == total,
                "every item started, 8 of them waiting for a place",
            )
            worker_a.send_signal(signal.SIGTERM)
            wait_for(
                lambda: Counter(item_statuses(url, batch_id).values())["queued"] == total - places,
                "the items waiting for a place handed back",
                30,
            )
            assert model.counts()["received"] == places, model.counts()
            model.configure(hold_unscripted=False)  # the 2 calls answered
            code = worker_a.wait(3 * soft_shutdown)
        log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        assert "not stopped" not in log and code == 0, (code, log[-2000:])
        assert Counter(item_statuses(url, batch_id).values()) == Counter(
            {"queued": total - places, "succeeded": places}
        )
        finished_once_by_another_worker(tmp_path, RecoveryStack(url, env, client), model,
                                        batch_id, total)  # fmt: skip


@pytest.mark.timeout(300)
def test_sigterm_hands_back_an_item_waiting_out_a_429_s_retry_after(
    tmp_path: Path, shared: RecoveryStack
) -> None:
    """SIGTERM while a batch item waits out the ``retry-after`` (20 s, within the default
    30 s deadline) of the 429 its model call met: the wait ends within a second, the retry
    is not sent, and the item goes back with its chunk (the warm shutdown ends at once, no
    run counted lost). The 429 was refused before the model read a token, so nothing was
    billed; it is kept with the item's claim, which stays ``running`` as a retry keeping
    calls does, and the next worker's run shows it in the item's usage beside its own call.
    Before, the retry-after was one sleep: the stop waited it out and sent the retry from the
    stopping worker, or was cut off at its stop deadline (counted lost). The run handed back
    charges none of the search's one deadline: its claim was let go with its time added (its
    retrieval, the call refused, its wait until the stop), so each rolling restart took that
    much from the next run's deadline, a reservation it then could not wait for
    (``budget_exhausted``: the hits not reranked), or none left at all.

    No process of the stopping worker (two here, as at the defaults on two cores) runs a
    message once its stop has begun: neither the chunk it hands back nor a batch sent then;
    the next worker runs both. Before, a process's event loop read Celery's stop flag only at
    its next turn, up to a second later, and the turn under way delivered what its poll
    returned: the hand-back came back within milliseconds to the stopping worker (its
    sibling process, whose item queue was not closed), and ran there to the end of the 429's
    pause, holding the stop that long (3 runs in 5 of a review's); here the later batch was
    taken so."""
    retry_after = 20
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with (
        FakeAnthropic(delay=MODEL_SECONDS) as model,
        recovery_stack(shared) as (url, env, client),
    ):
        env = {**env, "ANTHROPIC_BASE_URL": model.url}
        model.script([fa.status(429, retry_after=retry_after)])
        with worker(tmp_path / "w", env, "a", processes=2) as worker_a:  # a sibling stops too
            ingest(client)
            batch_id = submit(client, 1)
            wait_for(lambda: model.counts()["received"] >= 1, "the item's call refused")
            worker_a.send_signal(signal.SIGTERM)
            # once each process says its stop began, a new batch: no stopping process takes it
            wait_for(lambda: worker_log(tmp_path / "w", "a").count(WARM_SHUTDOWN) == 2, "stop")
            later = submit(client, 1, first=1)
            code = worker_a.wait(3 * soft_shutdown)
        log = worker_log(tmp_path / "w", "a")
        assert "not stopped" not in log and code == 0, (code, log[-2000:])
        assert "1 items handed back" in log and STOP_BEGINS in log, log[-2000:]
        # what a process takes in the instant between its sibling's hand-back and its own
        # stop it hands back at once (its item queue is born closed): none runs it, which the
        # model's one call and the later item still queued say; the log may show it taken
        chunk = next(task for task in tasks_received(log) if task.startswith(BATCH_CHUNK_TASK))
        assert model.counts()["received"] == 1  # the retry was not sent by the stopping worker
        assert item_statuses(url, batch_id) == {"q00000": "running"}  # keeping its 429
        assert item_statuses(url, later) == {"q00001": "queued"}  # not begun by a stopping one
        claims = redis.Redis.from_url(url, decode_responses=True)
        try:  # the deadline's time the runs so far used, what the next run is told it spent
            spent = float(claims.hget(BATCH_RUNS_KEY + batch_id, "q00000").split("|")[0])
        finally:
            claims.close()
        assert spent == 0.0  # the run handed back is not charged: the next has the whole deadline
        with worker(tmp_path / "w", env, "b"):
            wait_finished(client, url, batch_id, RECOVERY_WINDOW)
            wait_finished(client, url, later, RECOVERY_WINDOW)
        assert_batch_exactly_once(client, url, batch_id, 1)
        assert batch_counts(client, later)["counts"]["succeeded"] == 1
        # the 429'd call, then B's; the later batch's one call, B's
        assert model_calls(model) == Counter({"q00000": 2, "q00001": 1})
        b_log = worker_log(tmp_path / "w", "b")
        assert chunk in tasks_received(b_log), b_log[-2000:]  # the next worker ran it
        [line] = all_results(client, batch_id)
        assert line["result"]["usage"]["requests"] == 2, line  # both shown
        assert_no_run_lost(url, batch_id)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_sigterm_sends_no_retry_of_a_429_answered_as_the_stop_begins(
    tmp_path: Path, shared: RecoveryStack, pool: str
) -> None:
    """SIGTERM while a batch item's call is in flight, then its answer, a 429 of
    ``retry-after: 0.5``: the item goes back with its chunk, its retry not sent by the
    stopping worker, on either pool. The ``solo`` pool runs the chunk task in the consumer's
    event-loop thread: the hand-back waited (up to 2 s) for that busy loop to cancel the
    consumer before it closed the item queue, so the pause ended first and the stopping
    worker sent the retry, a second billed call; then the chunk's own hand-back waited 2 s
    more for the loop it was blocking."""
    with (
        FakeAnthropic(delay=MODEL_SECONDS) as model,
        recovery_stack(shared) as (_, env, client),
    ):
        env = child_env({**env, "ANTHROPIC_BASE_URL": model.url}, inherit_sift=False)
        model.configure(hold_until_received=2)  # the call waits unanswered...
        model.script([fa.status(429, retry_after=0.5)])
        with worker_process(tmp_path / "w", env, pool=pool) as stopping:
            ingest(client)
            submit(client, 1)
            wait_for(lambda: model.counts()["received"] == 1, "the item's call")
            stopping.send_signal(signal.SIGTERM)
            wait_for(lambda: WARM_SHUTDOWN in worker_log(tmp_path / "w", "worker"), "stop")
            model.configure(hold_until_received=0)  # ...until the stop has begun: the 429
            code = stopping.wait(60)
        log = worker_log(tmp_path / "w", "worker")
        assert code == 0, log[-3000:]
        assert model.counts()["received"] == 1, (pool, model.counts())  # no retry sent
        assert "1 items handed back" in log, log[-3000:]


@pytest.mark.timeout(600)
def test_sigterm_at_a_full_redis_keeps_the_calls_of_the_item_it_hands_back(
    tmp_path: Path, shared: RecoveryStack
) -> None:
    """The same stop during a 429's ``retry-after``, Redis at its ``maxmemory`` meanwhile
    (``noeviction``): the refused call is kept with the item's claim all the same, and shown
    in the item's usage once the next worker finishes it, beside its own. Before, Redis
    refused to keep it and the item went back as though it had been kept, its claim let go
    without it: the next run's usage showed one request of the two the model was sent. The
    chunk's message goes back on its queue there too, the worker exiting cleanly, and the
    next worker takes it at once. Before, Redis refused the hand-back's writes (its delivery
    counter, then kombu's requeue in a ``MULTI``): the chunk's task failed ("raised
    unexpected: OutOfMemoryError"), its message was acked, and the item waited for the
    re-drive (about 2.5 minutes here). A second batch's item, begun after the 429 and held
    by its pause before its model call, keeps no call: it goes back ``queued``, its chunk's
    message on the queue too (Redis refused that move, and its chunk failed the same way)."""
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with (
        FakeAnthropic(delay=MODEL_SECONDS) as model,
        recovery_stack(shared) as (url, env, client),
        redis.Redis.from_url(url) as r,
    ):
        env = {**env, "ANTHROPIC_BASE_URL": model.url}
        model.script([fa.status(429, retry_after=20)])
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit(client, 1)
            wait_for(lambda: model.counts()["received"] >= 1, "the item's call refused")
            # the pause written before the next batch: sent before it, on a loaded host, that
            # batch's call was made, answered and finished at the full Redis (the CI's failure)
            wait_for(lambda: _paused(r), "the 429's pause in the rate budget")
            waiting = submit(client, 1, first=1)  # its start paced on the 429's pause
            wait_for(lambda: item_statuses(url, waiting) == {"q00001": "running"}, "it runs")
            refused = _refused_for_oom(r)
            r.config_set("maxmemory", int(r.info("memory")["used_memory"]) // 2)
            try:
                worker_a.send_signal(signal.SIGTERM)
                code = worker_a.wait(3 * soft_shutdown)
                assert _refused_for_oom(r) > refused  # Redis did refuse the stop's writes
                state = broker_state(url)  # read while Redis is still full
            finally:
                r.config_set("maxmemory", 0)  # room again
        log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        assert log.count("1 items handed back") == 2, log[-3000:]
        assert "raised unexpected" not in log and code == 0, (code, log[-3000:])
        # each chunk's message is back on its queue, for the next worker to take at once
        assert state[BATCH_QUEUE] == 2 and state[KOMBU_UNACKED_KEY] == 0, state
        assert model.counts()["received"] == 1  # the retry was not sent by the stopping worker
        assert item_statuses(url, batch_id) == {"q00000": "running"}  # keeping its 429
        assert item_statuses(url, waiting) == {"q00001": "queued"}  # keeping nothing
        with worker(tmp_path / "w", env, "b"):
            wait_finished(client, url, batch_id, FINISH_TIMEOUT)
            wait_finished(client, url, waiting, FINISH_TIMEOUT)
        assert_batch_exactly_once(client, url, batch_id, 1)
        # the 429'd call, then B's; the waiting item's one call, B's
        assert model_calls(model) == Counter({"q00000": 2, "q00001": 1})
        [line] = all_results(client, batch_id)
        assert line["result"]["usage"]["requests"] == 2, line  # both shown
        [line] = all_results(client, waiting)
        assert batch_counts(client, waiting)["counts"]["succeeded"] == 1, line
        assert line["query_id"] == "q00001" and line["status"] == "succeeded", line
        assert line["result"]["usage"]["requests"] == 1, line


def _paused(client: redis.Redis) -> bool:
    """Whether a 429's pause is written in the rate budget (its end, on Redis's clock)."""
    keys = client.scan_iter(RATE_BUDGET_KEY + "*")
    return any(float(client.hget(key, "pause") or 0) > 0 for key in keys)


def _refused_for_oom(client: redis.Redis) -> int:
    """The writes Redis refused at its ``maxmemory`` so far."""
    return int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


@pytest.mark.timeout(300)
def test_sigterm_hands_back_the_items_whose_calls_timed_out_unanswered(
    tmp_path: Path, shared: RecoveryStack
) -> None:
    """SIGTERM at the defaults while a batch's two items are in their model calls and the
    model never answers: each call times out (20 s, within the 25 s stop deadline), nothing
    read, and the item goes back before its retry, its timed-out call kept with its claim;
    the worker exits with status 0. The next worker finishes each once, its usage showing
    both calls. Before, the stopping worker sent the retries and was cut off at its stop
    deadline, the items counted lost."""
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with FakeAnthropic() as model, recovery_stack(shared) as (url, env, client):
        env = {**env, "ANTHROPIC_BASE_URL": model.url}
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            answered_once(client, model)  # the deployment's first answer, before the hold
            model.configure(hold_unscripted=True)  # every call held, unanswered
            batch_id = submit(client, 2)
            wait_for(lambda: model.counts()["received"] >= 2, "both items in their calls")
            worker_a.send_signal(signal.SIGTERM)
            code = worker_a.wait(soft_shutdown + STOP_GRACE_SECONDS + 30)
        model.configure(hold_unscripted=False)
        log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        assert "not stopped" not in log and code == 0, (code, log[-2000:])
        assert "2 items handed back" in log, log[-2000:]
        assert model.counts()["received"] == 2  # no retry sent by the stopping worker
        with worker(tmp_path / "w", env, "b"):
            wait_finished(client, url, batch_id, RECOVERY_WINDOW)
        assert_batch_exactly_once(client, url, batch_id, 2)
        assert model_calls(model) == Counter({"q00000": 2, "q00001": 2})
        usage = [line["result"]["usage"]["requests"] for line in all_results(client, batch_id)]
        assert usage == [2, 2]  # the timed-out call shown beside the answered one
        assert_no_run_lost(url, batch_id)


@pytest.mark.timeout(300)
def test_a_stop_held_by_model_calls_names_the_items_at_its_deadline(
    tmp_path: Path, shared: RecoveryStack
) -> None:
    """SIGTERM while a batch's two items are in their model calls and the model never
    answers: the warm shutdown waits for them, and at the stop deadline the worker exits with
    its own status and a line naming them. The line blamed Redis ("Redis not answering?"),
    which answered all along, and the status was Celery's cold shutdown's. The calls' timeout
    and the search deadline are a minute here, so the calls outlast the stop deadline (25 s):
    at the defaults each call times out at 20 s, unanswered and nothing read, and its item is
    then handed back before its retry (the stop ends there)."""
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with FakeAnthropic() as model, recovery_stack(shared) as (_, env, client):
        env = {
            **env,
            "ANTHROPIC_BASE_URL": model.url,
            "SIFT_GENERATION_TIMEOUT_SECONDS": "60",
            "SIFT_SEARCH_DEADLINE_SECONDS": "60",
        }
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            answered_once(client, model)  # the deployment's first answer, before the hold
            model.configure(hold_unscripted=True)  # every call held, unanswered
            submit(client, 2)
            wait_for(lambda: model.counts()["received"] >= 2, "both items in their calls")
            worker_a.send_signal(signal.SIGTERM)
            code = worker_a.wait(soft_shutdown + STOP_GRACE_SECONDS + 30)
            model.configure(hold_unscripted=False)
        log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        gave_up = f"not stopped {soft_shutdown + STOP_GRACE_SECONDS:g} s after the stop signal"
        assert gave_up + " (2 batch items still running); exiting now" in log, log[-2000:]
        assert code == STOP_DEADLINE_STATUS


@pytest.mark.timeout(300)
def test_a_stop_held_by_a_search_s_model_call_names_the_search_at_its_deadline(
    tmp_path: Path, shared: RecoveryStack
) -> None:
    """The same with one single search in its model call (its deadline, 30 s by default,
    outlasts the 25 s stop deadline): the line names the search task, which held the stop as
    batch items do. It blamed Redis, which answered all along, since it counted batch items
    alone (reviewer's /tmp/rev21/rel/test_stop_line_blames_redis.py)."""
    soft_shutdown = Settings(_env_file=None).worker_soft_shutdown_seconds  # type: ignore[call-arg]
    with FakeAnthropic() as model, recovery_stack(shared) as (_, env, client):
        env = {**env, "ANTHROPIC_BASE_URL": model.url}
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            answered_once(client, model)  # the deployment's first answer, before the hold
            model.configure(hold_unscripted=True)  # every call held, unanswered
            submit_search(client, "who beat Kasparov")
            wait_for(lambda: model.counts()["received"] >= 1, "the search in its call")
            worker_a.send_signal(signal.SIGTERM)
            code = worker_a.wait(soft_shutdown + STOP_GRACE_SECONDS + 30)
            model.configure(hold_unscripted=False)
        log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        gave_up = f"not stopped {soft_shutdown + STOP_GRACE_SECONDS:g} s after the stop signal"
        held = f" (1 {SEARCH_TASK} task still running); exiting now"
        assert gave_up + held in log, log[-2000:]
        assert code == STOP_DEADLINE_STATUS


@pytest.mark.timeout(300)
def test_a_killed_worker_s_searches_and_their_webhooks_come_back(
    tmp_path: Path, model: FakeAnthropic, shared: RecoveryStack, receiver: Receiver
) -> None:
    """Single searches (each with a webhook) killed mid-rerank come back on a new worker:
    each ends ``succeeded`` and its ``search.completed`` webhook arrives."""
    n = 20
    model.reset()
    try:
        with recovery_stack(shared) as (_, env, client):
            with worker(tmp_path / "w", env, "a") as worker_a:
                ingest(client)
                answered_once(client, model)  # the deployment's first answer, not one of n
                model.configure(delay=8.0)  # the searches are all mid-rerank at the kill
                ids = [
                    client.post(
                        "/v1/searches",
                        json={
                            "index": INDEX,
                            "query": f"volcano item q{i:05d}",
                            "webhook_url": receiver.url,
                        },
                        headers=ACME,
                    ).json()["id"]
                    for i in range(n)
                ]
                wait_for(lambda: len(model.requests()) >= n, "every search at the model")
                worker_a.send_signal(signal.SIGKILL)
                worker_a.wait(10)
            assert not receiver.deliveries  # nothing had finished
            model.configure(delay=MODEL_SECONDS)
            started = time.monotonic()
            with worker(tmp_path / "w", env, "b"):
                wait_for(
                    lambda: len({d.body["data"]["id"] for d in receiver.deliveries}) == n,
                    "every search's webhook",
                    RECOVERY_WINDOW,
                )
                recovered = time.monotonic() - started
            print(f"\n{n} searches and their webhooks back {recovered:.1f}s after B started")
            statuses = {client.get(f"/v1/searches/{i}", headers=ACME).json()["status"] for i in ids}
            assert statuses == {"succeeded"}
            assert {d.body["data"]["id"] for d in receiver.deliveries} == set(ids)
            assert {d.body["data"]["status"] for d in receiver.deliveries} == {"succeeded"}
            assert set(model_calls(model).values()) == {2}  # once on A, once on B
    finally:
        model.configure(delay=MODEL_SECONDS)


@pytest.mark.timeout(300)
def test_a_webhook_whose_worker_is_killed_mid_delivery_is_delivered_by_the_next_worker(
    tmp_path: Path, model: FakeAnthropic, shared: RecoveryStack
) -> None:
    """A search's webhook at the receiver, unanswered, when its worker is SIGKILLed: its
    worker holds the attempt's claim (one per job, so that a second copy of the attempt
    waits), and that claim must not lose the webhook. The next worker's dead-worker check
    puts the message back once the dead worker's heartbeat is gone, and the message takes
    the attempt over from the dead claimant (no lease to wait out) and delivers it: the
    job's webhook shows ``delivered`` after 1 attempt (the one cut by the kill was never
    recorded), and the receiver had it twice."""
    with (
        recovery_stack(shared) as (url, env, client),
        slow_receiver() as receiver,  # holds each POST until released, then 204
    ):
        raw = redis.Redis.from_url(url, decode_responses=True)
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            job_id = submit_search(client, sample_queries()[0], webhook_url=receiver.url)
            wait_for(lambda: receiver.held == 1, "the first attempt at the receiver")
            claim = str(raw.hget(SEARCH_KEY + job_id, "webhook_claim"))
            worker_a.send_signal(signal.SIGKILL)
            worker_a.wait(10)
        receiver.release.set()  # from now on every POST is answered 204
        with worker(tmp_path / "w", env, "b"):
            wait_for(
                lambda: (
                    client.get(f"/v1/searches/{job_id}", headers=ACME).json()["webhook"]
                    == {"status": "delivered", "attempts": 1}
                ),
                "the webhook delivered by the next worker",
                RECOVERY_WINDOW,
            )
        raw.close()
    attempt, owner, *_ = claim.split("|")
    assert attempt == "1" and owner, claim  # held by the killed worker, by its id
    assert receiver.requests == 2


@pytest.mark.timeout(300)
def test_a_killed_worker_s_search_is_finished_by_the_next_worker_past_its_first_deadline(
    tmp_path: Path, model: FakeAnthropic, shared: RecoveryStack
) -> None:
    """A search killed mid-rerank comes back on a new worker once the dead worker's heartbeat
    is gone (10 s, then two checks): more than its deadline (8 s here: the setting under
    test; every other at its default) after its first start. The dead run's time is not
    charged (how long it ran is unknown): the new worker runs it and it succeeds. Charged to
    the takeover, it failed ``deadline_exceeded`` with no model call, as 275 in-flight items
    of a killed worker process's batch did in a CI run at the defaults."""
    model.reset()
    model.configure(delay=60.0)  # the search is mid-rerank at the kill
    try:
        with recovery_stack(shared) as (_, env, client):
            env = {**env, "SIFT_SEARCH_DEADLINE_SECONDS": "8"}
            with worker(tmp_path / "w", env, "a") as worker_a:
                ingest(client)
                body = {"index": INDEX, "query": "volcano item q00000"}
                created = client.post("/v1/searches", json=body, headers=ACME)
                assert created.status_code == 202, created.text
                job_id = created.json()["id"]
                wait_for(lambda: len(model.requests()) >= 1, "the search at the model")
                worker_a.send_signal(signal.SIGKILL)
                worker_a.wait(10)
            model.configure(delay=MODEL_SECONDS)  # the provider answers again
            with worker(tmp_path / "w", env, "b"):
                wait_for(
                    lambda: (
                        client.get(f"/v1/searches/{job_id}", headers=ACME).json()["status"]
                        in {"succeeded", "failed"}
                    ),
                    "the search final",
                    RECOVERY_WINDOW,
                )
            job = client.get(f"/v1/searches/{job_id}", headers=ACME).json()
            calls = len(model.requests())
        assert job["status"] == "succeeded", job
        assert job["result"]["rerank"]["applied"] is True, job["result"]["rerank"]
        assert calls == 2, calls  # the dead run's call died with it; the new run's answered
    finally:
        model.configure(delay=MODEL_SECONDS)
