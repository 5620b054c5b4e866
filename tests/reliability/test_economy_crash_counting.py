"""The economy lane when its worker is SIGKILLed just after it counted a result line in
the metrics (before the item's run was saved, before the fix), at default settings (the
stack of :mod:`tests.reliability.economy`): the new worker's poll counts that line no second
time; the tokens counted, the item's record and the bill agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic, malformed, status, succeeded
from tests.reliability.economy import (
    FINISH_WINDOW,
    crash_settings,
    economy_stack,
    finished,
    submit_economy,
    worker,
)
from tests.reliability.support import all_results, assert_batch_exactly_once, ingest, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


@pytest.mark.parametrize("first", ["succeeded", "malformed"])
def test_a_poll_killed_after_counting_a_result_counts_it_once(tmp_path: Path, first: str) -> None:
    # The economy recorder writes every usage count to a file (a killed worker's counters die
    # with it) and kills the worker after the first attempt counted. Worker B runs the
    # redelivered poll: it must find the line counted and finish the item without counting
    # it again. "malformed": an answer that fails the schema (billed), resubmitted, then
    # answered.
    crashes = tmp_path / "crashes"
    with (
        FakeAnthropic() as model,
        economy_stack(tmp_path, model, **crash_settings(crashes)) as (env, client),
    ):
        if first == "malformed":
            model.script_batch({"i0": [succeeded(malformed("not json")), succeeded()]})
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 1)
            wait_for(lambda: worker_a.poll() is not None, "worker A killed after a count", 180)
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW * 2)
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 1)
        billed = model.usage()
        counted = [json.loads(line) for line in (crashes / "counted").read_text().splitlines()]
        assert len(counted) == billed["responses"] == (2 if first == "malformed" else 1), counted
        assert sum(c["input"] for c in counted) == billed["input_tokens"], counted
        assert sum(c["output"] for c in counted) == billed["output_tokens"], counted
        [item] = all_results(client, batch_id)
        usage = item["result"]["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (
            billed["input_tokens"],
            billed["output_tokens"],
        )
        outcomes = [a["outcome"] for a in item["result"]["trace"]["attempts"]]
        assert outcomes == (["malformed", "ok"] if first == "malformed" else ["ok"]), outcomes


def test_a_submission_killed_after_counting_a_refused_item_counts_each_item_once(
    tmp_path: Path,
) -> None:
    # Both creates are refused for good (400): each item fails http_4xx, one attempt each.
    # The recorder kills worker A just after it counted the first item's attempt; worker B
    # runs the redelivered submission. Before the fix, A counted that attempt before the
    # item's failure was saved, so B failed the item again and counted it a second time:
    # three http_4xx attempts in the metrics, two on the records.
    crashes = tmp_path / "crashes"
    with (
        FakeAnthropic() as model,
        economy_stack(tmp_path, model, **crash_settings(crashes, "http_4xx")) as (env, client),
    ):
        refused = status(400, message="requests: refused")
        model.script_batch_calls("create", [refused, refused])
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 2)
            wait_for(lambda: worker_a.poll() is not None, "worker A killed after a count", 180)
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW * 2)
        assert model.batches() == []  # nothing was made: no line, no bill
        items = all_results(client, batch_id)
        assert [item["status"] for item in items] == ["failed", "failed"], items
        assert all("http_4xx" in item["error"]["message"] for item in items), items
        counted = (crashes / "attempts").read_text().split()
        assert counted == ["http_4xx", "http_4xx"], counted  # one per item, as the records
