"""The economy lane when its worker is SIGKILLed while settling a create in doubt, at
default settings (the stack of :mod:`tests.reliability.economy`): the new worker settles
again, polls the candidate kept, finds it another client's, and sends the items again; no
item is left waiting.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic, status
from tests.reliability.economy import FINISH_WINDOW, economy_stack, finished, submit_economy, worker
from tests.reliability.support import all_results, assert_batch_exactly_once, ingest, wait_for
from worker.constants import ECONOMY_PROVIDERS_KEY, ECONOMY_RUNS_KEY, ECONOMY_WATCH_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _foreign_batch(model: FakeAnthropic, requests: int) -> str:
    """Another client's provider batch in the same workspace: ``requests`` requests, now."""
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test")
    params = {"model": "claude-haiku-4-5", "max_tokens": 16,
              "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    made = sdk.messages.batches.create(
        requests=[{"custom_id": f"x{i}", "params": params} for i in range(requests)]  # type: ignore[misc]
    )
    return made.id


def test_a_worker_killed_while_settling_a_create_in_doubt_leaves_no_item_waiting(
    tmp_path: Path,
) -> None:
    # A create answered 500 (it made nothing) is in doubt; the next submission looks for it
    # and finds one candidate, another client's batch. Killed once the candidate is kept
    # (recorded and watched) but before the items' runs say they wait on it: the state
    # settle_doubts leaves when it is killed between its writes, made here. The new worker
    # settles again, polls the candidate, finds it foreign, and sends the items again.
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        model.configure(batch_processing_seconds=5.0)
        broker = redis.Redis.from_url(env["SIFT_REDIS_URL"], decode_responses=True)
        foreign = _foreign_batch(model, 3)
        model.script_batch_calls("create", [status(500)])

        def pendings() -> list[dict[str, Any]]:
            runs = [json.loads(r) for r in broker.hvals(ECONOMY_RUNS_KEY + batch_id)]
            return [r["pending"] for r in runs if r.get("pending")]

        with worker(tmp_path / "w", env, "a") as worker_a:
            ingest(client)
            batch_id = submit_economy(client, 3)
            wait_for(lambda: len(pendings()) == 3, "the create in doubt", 120)
            worker_a.send_signal(signal.SIGKILL)  # its submission waiting out its 30 s
            worker_a.wait(10)
        [submission] = {p["submission"] for p in pendings()}
        kept = {"round": 1, "requests": 3, "created_at": time.time(), "ended_at": None,
                "submission": submission, "doubt": True}  # fmt: skip
        broker.hset(ECONOMY_PROVIDERS_KEY + batch_id, foreign, json.dumps(kept))
        broker.zadd(ECONOMY_WATCH_KEY, {f"{batch_id} {foreign}": time.time() + 330})
        with worker(tmp_path / "w", env, "b"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        assert_batch_exactly_once(client, env["SIFT_REDIS_URL"], batch_id, 3)
        made = model.batches()
        assert len(made) == 2 and made[0]["id"] == foreign  # and the one resend
        for item in all_results(client, batch_id):
            assert item["status"] == "succeeded", item
            assert item["result"]["trace"]["attempts"][-1]["provider_batch"] == made[1]["id"]
