"""Redis down past the worker's retries while searches run: no paid answer thrown away, and
no outage charged to a job's re-drives.

``test_redis_outage_past_retries`` keeps Redis down past the client's retries once, the held
calls answered ``529`` (billed nothing). A run that meets that ends without a finish, its job
left ``running`` for the re-drive's copy. Here:

- the held calls of a batch's items and a search are answered ``200`` (billed) once Redis is
  gone, and Redis stays down until every run has given up (the worker's log says its task
  waits for Redis to settle them): its keep of the answer in its run claim, then its job's
  finish, each past the client's ``OUTAGE_SECONDS``. The answer was dropped with its run, and
  the copy paid the model again: every job billed twice;
- one search's runs meet four outages in a row: each re-drive was counted against
  ``SIFT_TASK_MAX_DELIVERIES`` (3), so the fourth was sent as poison, and the search failed
  ``delivery_limit_exceeded`` with no fault of its own.

At the defaults, no setting shortened: the fake model holds each run's call, redis-server is
SIGKILLed and comes back on its AOF once the worker's log says the runs ended (several
minutes in all).
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic, status
from tests.reliability.support import (
    ACME,
    FINISH_TIMEOUT,
    Broker,
    all_results,
    assert_batch_exactly_once,
    batch_counts,
    broker,
    ingest,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.services import gateway
from worker.processes.stack import child_env, worker_process
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import Settings

pytestmark = pytest.mark.integration

ITEMS = 6  # one chunk's worth, all in their model call at once
HELD = 10**9  # the fake answers nothing until this many calls came in: held until lowered


def _search(client: httpx.Client, search_id: str) -> dict[str, object]:
    response = client.get(f"/v1/searches/{search_id}", headers=ACME)
    response.raise_for_status()
    body: dict[str, object] = response.json()
    return body


def _defaults(redis_url: str, model_url: str) -> dict[str, str]:
    env = stack_env(redis_url, model_url)
    env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # the defaults, as a user runs them
    env.pop("SIFT_WEBHOOK_RETRY_SCALE")
    return child_env(env, inherit_sift=False)


def _left(log: Path) -> int:
    """How many runs the worker's log says met Redis down past their retries and ended."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.count("Redis failed during its run; left for a redelivery")


def _settling(log: Path) -> int:
    """How many tasks the worker's log says wait for Redis to settle their runs it ended."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.count("Redis unreachable ended its run; waiting")


def _down_while_held(redis_broker: Broker, url: str) -> None:
    """Kill redis-server once what was written (the runs' claims) is on its AOF."""
    direct = redis.Redis.from_url(url)
    try:
        redis_broker.written(direct)
    finally:
        direct.close()
    redis_broker.kill(signal.SIGKILL)


@pytest.mark.timeout(600)
def test_an_answer_that_comes_while_redis_is_down_past_the_retries_is_billed_once(
    tmp_path: Path,
) -> None:
    with (
        FakeAnthropic(hold_until_received=HELD) as model,
        broker(tmp_path / "redis") as redis_broker,
    ):
        url = redis_broker.url + "/0"
        env = _defaults(url, model.url)
        with (
            worker_process(tmp_path / "w", env),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            batch_id = submit_batch(client, ITEMS)
            search_id = submit_search(client, "which engine beat the world champion")
            wait_for(lambda: model.counts()["received"] == ITEMS + 1, "every call held")
            _down_while_held(redis_broker, url)
            model.configure(hold_until_received=0)  # each run's answer, billed
            wait_for(lambda: model.counts()["statuses"].get("200") == ITEMS + 1, "the answers")
            # each run's keep of its answer, then its job's finish, retries for
            # OUTAGE_SECONDS each: Redis stays down until both tasks' runs have given up
            log = tmp_path / "w" / "worker.log"
            wait_for(lambda: _settling(log) == 2, "every run ended", 8 * OUTAGE_SECONDS)
            redis_broker.start_again()

            def finished() -> bool:
                done = batch_counts(client, batch_id)["finished_at"] is not None
                return done and _search(client, search_id)["status"] != "running"

            wait_for(finished, "the batch and the search final", FINISH_TIMEOUT)
            search = _search(client, search_id)
            errors = {
                r["query_id"]: r["error"] for r in all_results(client, batch_id) if "error" in r
            }
            assert (search["status"], errors) == ("succeeded", {}), (search.get("error"), errors)
            assert_batch_exactly_once(client, url, batch_id, ITEMS)
            # one answer paid per job: the copies finished on the answers their runs held
            assert model.counts()["statuses"] == {"200": ITEMS + 1}
            usages = [r["result"]["usage"] for r in all_results(client, batch_id)]
            assert [u["requests"] for u in usages] == [1] * ITEMS
            result = search["result"]
            assert isinstance(result, dict) and result["usage"]["requests"] == 1, result
            # the premise: each run's keep of its answer met Redis down past its retries
            text = log.read_text(errors="replace")
            assert text.count("could not be kept with the run claim") == ITEMS + 1


@pytest.mark.timeout(900)
def test_a_search_that_meets_more_outages_than_its_redrives_still_succeeds(
    tmp_path: Path,
) -> None:
    outages = Settings.model_fields["task_max_deliveries"].default + 1  # one past its re-drives
    with (
        FakeAnthropic(hold_until_received=HELD) as model,
        broker(tmp_path / "redis") as redis_broker,
    ):
        url = redis_broker.url + "/0"
        env = _defaults(url, model.url)
        with (
            worker_process(tmp_path / "w", env),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            search_id = submit_search(client, "which engine beat the world champion")
            log = tmp_path / "w" / "worker.log"
            for outage in range(1, outages + 1):
                # the search's run (the first, or a re-drive's copy) is in its model call
                wait_for(
                    lambda n=outage: model.counts()["received"] == n,
                    f"run {outage} in its call",
                    FINISH_TIMEOUT,
                )
                _down_while_held(redis_broker, url)
                model.script([status(529)])  # billed nothing; its bookkeeping meets Redis down
                model.configure(hold_until_received=0)
                wait_for(lambda n=outage: model.counts()["statuses"].get("529") == n, "the 529")
                model.configure(hold_until_received=HELD)  # the next run's call, held
                # the answer's bookkeeping retries for OUTAGE_SECONDS: Redis comes back once
                # the run has given up and ended
                wait_for(
                    lambda n=outage: _left(log) == n, f"run {outage} ended", 6 * OUTAGE_SECONDS
                )
                redis_broker.start_again()

            def last_run_or_end() -> bool:
                received = model.counts()["received"]
                return received > outages or _search(client, search_id)["status"] != "running"

            wait_for(last_run_or_end, "another run, or the search's end", FINISH_TIMEOUT)
            model.configure(hold_until_received=0)
            wait_for(lambda: _search(client, search_id)["status"] != "running", "the search final")
            search = _search(client, search_id)
            assert search["status"] == "succeeded", search.get("error")
            assert model.counts()["statuses"] == {"529": outages, "200": 1}
            assert _left(log) == outages
