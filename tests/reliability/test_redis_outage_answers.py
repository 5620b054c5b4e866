"""Redis down past the worker's retries while a search runs, again and again: no outage
charged to the search's re-drives.

``test_redis_outage_past_retries`` keeps Redis down past the client's retries once. A run
that meets that ends without a finish, its job left ``running`` for the re-drive's copy; each
such re-drive was counted against ``SIFT_TASK_MAX_DELIVERIES`` (3), so a search whose runs met
four outages in a row had its fourth re-drive sent as poison, and failed
``delivery_limit_exceeded`` with no fault of its own.

At the defaults, no setting shortened: the fake model holds each run's call, redis-server is
SIGKILLed, the call is answered ``529`` (billed nothing), and the answer's bookkeeping meets
Redis down past the client's ``OUTAGE_SECONDS``; redis-server comes back on its AOF once the
worker's log says the run ended (a few minutes in all).
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
    broker,
    ingest,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import gateway
from worker.processes.stack import child_env, worker_process
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import Settings

pytestmark = pytest.mark.integration

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


def _down_while_held(redis_broker: Broker, url: str) -> None:
    """Kill redis-server once what was written (the runs' claims) is on its AOF."""
    direct = redis.Redis.from_url(url)
    try:
        redis_broker.written(direct)
    finally:
        direct.close()
    redis_broker.kill(signal.SIGKILL)


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
