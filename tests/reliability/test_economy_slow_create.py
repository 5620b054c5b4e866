"""The economy lane when a submission's create is slow and its message runs twice, at
default settings (the stack of :mod:`tests.reliability.economy`).

- the submission's message delivered again while its run's create is still under way (no
  provider batch made yet): the second run stands down; one provider batch;
- the submission's worker stalled (SIGSTOP) past its heartbeat during that slow create: its
  message goes to another worker, whose run takes the lease over and finds the create in
  doubt with no candidate yet; it waits out the doubt window rather than send the items
  again; one provider batch.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic, slow
from tests.reliability.economy import FINISH_WINDOW, economy_stack, finished, submit_economy, worker
from tests.reliability.support import all_results, assert_batch_exactly_once, ingest, wait_for
from worker.constants import ECONOMY_RUNS_KEY, ECONOMY_SUBMIT_TASK, KOMBU_UNACKED_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _pending(broker: redis.Redis, batch_id: str) -> int:
    """How many of the batch's items wait on a create recorded but not yet answered."""
    runs = [json.loads(r) for r in broker.hvals(ECONOMY_RUNS_KEY + batch_id)]
    return sum(1 for r in runs if r.get("pending"))


def _assert_one_provider_batch_answered_all(
    model: FakeAnthropic, client: httpx.Client, env: dict[str, str], batch_id: str, items: int
) -> None:
    """One provider batch made (paid once), holding every item, and each item answered by
    it in one attempt, finished exactly once."""
    made = model.batches()
    assert len(made) == 1, [b["id"] for b in made]
    assert len(made[0]["custom_ids"]) == items
    assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, items)
    for item in all_results(client, batch_id):
        assert item["status"] == "succeeded", item
        attempts = item["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["ok"], attempts
        assert attempts[0]["provider_batch"] == made[0]["id"]


def test_the_same_submission_delivered_again_during_its_slow_create_stands_down(
    tmp_path: Path,
) -> None:
    # The submission's create takes 20 s before the provider makes the batch (a large body),
    # and its message is delivered again meanwhile (as kombu's restore does once the
    # visibility timeout passes, the run still going on): the same message, the same task
    # id, run by a second thread. It must stand down: run on, it would find the create in
    # doubt, no provider batch made yet, and send the items again: two provider batches.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        model.script_batch_calls("create", [slow(20.0)])

        with worker(tmp_path / "w", env, "a"):
            ingest(client)
            batch_id = submit_economy(client, 3)
            wait_for(lambda: _pending(broker, batch_id) == 3, "the slow create under way", 120)
            [held] = [
                json.loads(raw)[0]
                for raw in broker.hvals(KOMBU_UNACKED_KEY)
                if json.loads(raw)[0]["headers"]["task"] == ECONOMY_SUBMIT_TASK
            ]
            broker.lpush("sift.batch", json.dumps(held))  # the same message, again
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
            log = (tmp_path / "w" / "a.log").read_text(errors="replace")
        _assert_one_provider_batch_answered_all(model, client, env, batch_id, 3)
        assert "this one stands down" in log


def test_a_submission_taken_over_from_a_stalled_worker_waits_for_its_create_in_flight(
    tmp_path: Path,
) -> None:
    # Worker A's create takes 60 s before the provider makes the batch, and A stalls meanwhile
    # (SIGSTOP: a VM paused, a swap storm) past its heartbeat's TTL: worker B's dead-worker
    # check gives A's submission message back, and B's run takes the lease over. The create
    # it finds in doubt has no candidate yet, but its call never came back: it may still be
    # under way, as it is. B must not send the items again before the doubt window ends (two
    # provider batches, paid twice); A, resumed, records the one it made.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        model.script_batch_calls("create", [slow(60.0)])

        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 3)
            wait_for(lambda: _pending(broker, batch_id) == 3, "the slow create under way", 120)
            with worker(tmp_path / "w", env, "b"):
                worker_a.send_signal(signal.SIGSTOP)
                try:
                    log_b = tmp_path / "w" / "b.log"
                    wait_for(
                        lambda: "of dead worker" in log_b.read_text(errors="replace"),
                        "A's submission given back",
                        60,
                    )
                    wait_for(lambda: len(model.batches()) >= 1, "the slow create's batch", 120)
                finally:
                    worker_a.send_signal(signal.SIGCONT)
                wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        _assert_one_provider_batch_answered_all(model, client, env, batch_id, 3)
        assert "may still be under way" in log_b.read_text(errors="replace")
