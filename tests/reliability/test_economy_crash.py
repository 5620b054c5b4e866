"""The economy lane when its worker is SIGKILLed, at default settings.

A real stack of the test's own (redis-server, the gateway under uvicorn, ``sift worker``
processes, the fake Messages API on loopback HTTP with the real SDK); every ``SIFT_``
setting at its default (the economy lane's first poll after 30 s, the dead-worker check)
except what a test cannot run without (the Redis URL, the keys, the model's address).

- killed while its create call waits for the answer (the provider batch already made, its
  id not yet recorded): the new worker finds that provider batch instead of making a second
  one; every item is answered once, from it;
- killed half-way through recording a provider batch's results: the new worker maps the
  rest, every item finished once, with one attempt, and one ``batch.completed`` webhook;
- killed just after it counted a result line in the metrics (before the item's run was
  saved, before the fix): the new worker's poll counts that line no second time; the tokens
  counted, the item's record and the bill agree;
- (a poll's message lost, or late, after its worker was killed: test_economy_lost_polls.py)
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic, malformed, stall, status, succeeded
from tests.reliability.support import (
    Receiver,
    all_results,
    assert_batch_exactly_once,
    batch_counts,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
    webhook_receiver,
)
from tests.services import gateway, redis_server
from worker.constants import (
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_WATCH_KEY,
)
from worker.stack import child_env, worker_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CREATE_ANSWER_SECONDS = 20.0  # the create's answer comes this long after the batch was made
FINISH_WINDOW = 240.0  # from the new worker's start: dead-worker check + a 30 s poll + slack


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    yield from webhook_receiver()


@contextmanager
def economy_stack(
    tmp_path: Path, model: FakeAnthropic, **extra: str
) -> Iterator[tuple[dict[str, str], httpx.Client]]:
    with redis_server(tmp_path / "redis") as base_url:
        env = stack_env(base_url + "/0", model.url, **extra)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # back to its default
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            yield env, client


@contextmanager
def worker(directory: Path, env: dict[str, str], name: str) -> Iterator[subprocess.Popen[bytes]]:
    with worker_process(directory, child_env(env, inherit_sift=False), name) as proc:
        yield proc


def submit_economy(client: httpx.Client, n: int, webhook_url: str | None = None) -> str:
    return submit_batch(client, n, webhook_url=webhook_url, lane="economy", include_trace=True)


def finished(client: httpx.Client, batch_id: str) -> bool:
    return batch_counts(client, batch_id)["finished_at"] is not None


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


@pytest.mark.parametrize("first", ["succeeded", "malformed"])
def test_a_poll_killed_after_counting_a_result_counts_it_once(tmp_path: Path, first: str) -> None:
    # The economy recorder writes every usage count to a file (a killed worker's counters die
    # with it) and kills the worker after the first attempt counted. Worker B runs the
    # redelivered poll: it must find the line counted and finish the item without counting
    # it again. "malformed": an answer that fails the schema (billed), resubmitted, then
    # answered.
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    factory = "tests.reliability.economy_counting_runtime:build_runtime"
    with (
        FakeAnthropic() as model,
        economy_stack(
            tmp_path, model, SIFT_RUNTIME_FACTORY=factory, CRASH_ONCE_DIR=str(crashes)
        ) as (env, client),  # fmt: skip
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
