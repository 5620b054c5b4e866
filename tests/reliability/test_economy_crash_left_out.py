"""The economy lane when its worker is SIGKILLed between mapping the requests a provider
batch's results left out and resubmitting them, at default settings (the stack of
:mod:`tests.reliability.economy`): the new worker's poll maps the file again, counts nothing
twice, and sends each left-out request again exactly once; every item is answered once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.fake_anthropic import FakeAnthropic, missing
from tests.reliability.economy import (
    FINISH_WINDOW,
    crash_settings,
    economy_stack,
    finished,
    submit_economy,
    worker,
)
from tests.reliability.support import (
    Receiver,
    all_results,
    assert_batch_exactly_once,
    batch_counts,
    ingest,
    wait_for,
    webhook_receiver,
)
from worker.constants import ECONOMY_RUNS_KEY
from worker.queue.economy.ids import position_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

N = 6
LEFT_OUT = {1, 4}  # positions the first provider batch's results file leaves out


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    yield from webhook_receiver()


def test_a_poll_killed_before_resubmitting_the_left_out_requests_sends_each_once(
    tmp_path: Path, hooks: Receiver
) -> None:
    # The first provider batch's results leave two requests out: each is a ``malformed``
    # result of its item, resubmitted. Worker A's economy recorder kills it as it counts the
    # first such result (``CRASH_AFTER_OUTCOME``): the left-out items' runs are saved
    # (``resubmit``, ``handled``), nothing is sent yet, and no write comes between that
    # instant and the resubmission's first. Worker B runs the redelivered poll.
    crashes = tmp_path / "crashes"
    with (
        FakeAnthropic() as model,
        economy_stack(tmp_path, model, **crash_settings(crashes, "malformed")) as (env, client),
    ):
        model.script_batch({f"i{p}": [missing()] for p in LEFT_OUT})
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, N, webhook_url=hooks.url)
            wait_for(lambda: worker_a.poll() is not None, "worker A killed at a left-out", 180)
        # killed in the window: the left-out requests mapped, none sent again
        assert (crashes / "die-after-count").exists()
        [first] = model.batches()
        outcomes = zip(first["custom_ids"], first["outcomes"], strict=True)
        assert {position_of(c) for c, kind in outcomes if kind == "missing"} == LEFT_OUT
        runs = {
            json.loads(raw)["pos"]: json.loads(raw)
            for raw in broker.hvals(ECONOMY_RUNS_KEY + batch_id)
        }
        for position in LEFT_OUT:
            run = runs[position]
            assert run["resubmit"] and run["handled"] == first["id"], run
            assert run["provider"] == first["id"] and run["pending"] is None, run
        at_kill = batch_counts(client, batch_id)["counts"]
        assert (at_kill["running"], at_kill["succeeded"]) == (len(LEFT_OUT), N - len(LEFT_OUT))
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
            wait_for(lambda: len(hooks.for_job(batch_id)) >= 1, "the batch.completed webhook", 60)
        assert "of dead worker" in (tmp_path / "w" / "b.log").read_text(errors="replace")
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, N)
        batch = batch_counts(client, batch_id)
        counts = batch["counts"]
        assert counts["total"] == N == sum(v for k, v in counts.items() if k != "total"), batch
        # each left-out request went to the provider again exactly once, alone
        made = model.batches()
        assert [b["id"] for b in made[:1]] == [first["id"]] and len(made) == 2, made
        sent = Counter(position_of(cid) for b in made for cid in b["custom_ids"])
        assert sent == {p: 1 + (p in LEFT_OUT) for p in range(N)}, sent
        assert {position_of(cid) for cid in made[1]["custom_ids"]} == LEFT_OUT
        # each item answered once, paid once: its attempts, and the bill
        billed = model.usage()
        results = all_results(client, batch_id)
        assert billed["responses"] == N
        assert sum(r["result"]["usage"]["input_tokens"] for r in results) == billed["input_tokens"]
        assert (
            sum(r["result"]["usage"]["output_tokens"] for r in results) == billed["output_tokens"]
        )
        for position, item in enumerate(results):
            attempts = item["result"]["trace"]["attempts"]
            trail = [(a["outcome"], a["provider_batch"]) for a in attempts]
            if position in LEFT_OUT:
                assert trail == [("malformed", first["id"]), ("ok", made[1]["id"])], attempts
            else:
                assert trail == [("ok", first["id"])], attempts
        deliveries = hooks.for_job(batch_id)
        assert len(deliveries) == 1, [d.body for d in deliveries]
        assert deliveries[0].headers.get("webhook-id") == f"msg_{batch_id}"
        assert deliveries[0].body["type"] == "batch.completed"
        assert deliveries[0].body["data"]["status"] == batch["status"] == "succeeded"
