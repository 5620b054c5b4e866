"""The economy lane when its worker is SIGKILLed, at default settings (the stack of
:mod:`tests.reliability.economy`).

- killed while its create call waits for the answer (the provider batch already made, its
  id not yet recorded): the new worker finds that provider batch instead of making a second
  one; every item is answered once, from it;
- killed half-way through recording a provider batch's results: the new worker maps the
  rest, every item finished once, with one attempt, and one ``batch.completed`` webhook;
- (killed while settling a create in doubt: test_economy_crash_doubt.py; just after it
  counted a result line: test_economy_crash_counting.py; between mapping the requests a
  results file left out and resubmitting them: test_economy_crash_left_out.py; a poll's
  message lost, or late, after its worker was killed: test_economy_lost_polls.py)
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic, stall
from tests.reliability.economy import FINISH_WINDOW, economy_stack, finished, submit_economy, worker
from tests.reliability.support import (
    Receiver,
    all_results,
    assert_batch_exactly_once,
    batch_counts,
    ingest,
    wait_for,
    webhook_receiver,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CREATE_ANSWER_SECONDS = 20.0  # the create's answer comes this long after the batch was made


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    yield from webhook_receiver()


def test_a_worker_killed_inside_its_create_call_makes_no_second_provider_batch(
    tmp_path: Path,
) -> None:
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        model.script_batch_calls("create", [stall(CREATE_ANSWER_SECONDS)])
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 5)
            wait_for(lambda: len(model.batches()) == 1, "the provider batch made", 120)
            worker_a.send_signal(signal.SIGKILL)  # its create still waiting for the answer
            worker_a.wait(10)
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        assert "of dead worker" in (tmp_path / "w" / "b.log").read_text(errors="replace")
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 5)
        [made] = model.batches()  # one provider batch, paid once
        for item in all_results(client, batch_id):
            attempts = item["result"]["trace"]["attempts"]
            assert [a["outcome"] for a in attempts] == ["ok"], attempts
            assert attempts[0]["provider_batch"] == made["id"]


def test_a_worker_killed_while_recording_results_leaves_each_item_finished_once(
    tmp_path: Path, hooks: Receiver
) -> None:
    n = 3_000  # one provider batch whose results take the worker a while to record
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, n, webhook_url=hooks.url)
            wait_for(
                lambda: batch_counts(client, batch_id)["counts"]["succeeded"] > 0,
                "the first results recorded",
                180,
            )
            worker_a.send_signal(signal.SIGKILL)
            worker_a.wait(10)
        done_at_kill = batch_counts(client, batch_id)["counts"]["succeeded"]
        print(f"\nworker A killed with {done_at_kill} of {n} results recorded")
        assert done_at_kill < n, "the results were all recorded before the kill"
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
            wait_for(lambda: len(hooks.for_job(batch_id)) >= 1, "the batch.completed webhook", 60)
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, n)
        assert len(model.batches()) == 1
        for item in all_results(client, batch_id):
            assert [a["outcome"] for a in item["result"]["trace"]["attempts"]] == ["ok"]
        deliveries = hooks.for_job(batch_id)
        assert {d.headers.get("webhook-id") for d in deliveries} == {f"msg_{batch_id}"}
        assert {d.body["data"]["status"] for d in deliveries} == {"succeeded"}
