"""What a search cost, told truthfully over the real stack: a failed rerank still reports the
usage its billed attempts reported, and a model with no price has an unknown cost (``null``),
counted in ``sift_rerank_unpriced_calls_total`` and warned about when the worker starts."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from standardwebhooks.webhooks import Webhook

from tests.e2e.conftest import (
    ACME,
    INDEX,
    KEYS,
    MODEL,
    Stack,
    finished_batch,
    unpriced_stack,
    worker_usage,
)
from tests.fake_anthropic import USAGE_FIELDS, cut, good, malformed, positions, status
from tests.services import free_port, webhook_inbox
from worker.adapters.rate_budget import OFF_REFRESH_SECONDS, RedisRateBudget
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.processes.stack import child_env, sift_command
from worker.settings import DEFAULT_PRICES


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in USAGE_FIELDS}


def _search(client: httpx.Client, query: str) -> dict[str, Any]:
    response = client.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": INDEX, "query": query, "rerank": True},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def test_a_failed_rerank_reports_its_billed_usage_on_the_job(stack: Stack, corpus: object) -> None:
    # three answers the provider bills but that are not in the schema: fail_closed fails the
    # search, and the job still says what the three calls used and cost
    before = stack.model.usage()
    stack.model.script([malformed("no json here")] * 3)
    job = _search(stack.live, "green tea leaves")
    billed = _delta(stack.model.usage(), before)
    assert job["status"] == "failed", job
    assert job["error"]["type"] == "rerank_failed"
    usage = job["error"]["usage"]
    assert usage["requests"] == 3
    assert billed["input_tokens"] > 0
    assert {name: usage[name] for name in USAGE_FIELDS} == billed
    expected = cost_usd(TokenUsage(**billed), price_for(MODEL, DEFAULT_PRICES))
    assert expected is not None and expected > 0
    assert usage["cost_usd"] == pytest.approx(expected)


def test_sift_search_says_what_a_failed_search_was_billed(stack: Stack, corpus: object) -> None:
    """``sift search --rerank`` of a search that fails after three billed calls: the usage
    line, on stderr before the error; ``--json``'s job carries it as ``error.usage``. The
    CLI printed the error alone: what the three calls cost was not shown."""
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001"})
    for extra in ((), ("--json",)):
        before = stack.model.usage()
        stack.model.script([malformed("no json")] * 3)
        done = subprocess.run(
            sift_command("search", "green tea leaves", "--index", INDEX, "--rerank", *extra),
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        billed = _delta(stack.model.usage(), before)
        assert done.returncode == 1, done.stdout + done.stderr
        said = " ".join(done.stderr.split())
        usage = f"usage: 3 request(s), {billed['input_tokens']} input + "
        usage += f"{billed['output_tokens']} output tokens"
        assert billed["input_tokens"] > 0
        assert usage in said, said
        assert said.index(usage) < said.index("error: search"), said
        if extra:
            job = json.loads(done.stdout)
            assert {k: job["error"]["usage"][k] for k in USAGE_FIELDS} == billed
        else:
            assert done.stdout == ""


def test_sift_search_trace_prints_the_trace_of_a_search_that_failed(
    stack: Stack, corpus: object
) -> None:
    """``sift search --rerank --trace`` of a search whose rerank fails for good (three answers
    not in the schema, ``fail_closed``): the trace it asked for, which the failed job keeps as
    ``error.trace``, is printed as a succeeded search's is, each attempt with its class and
    the failure named, then the usage line and the error on stderr. It printed the usage and
    the error alone: what each attempt met was not shown, the trace asked for dropped."""
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001"})
    stack.model.script([malformed("no json")] * 3)
    done = subprocess.run(
        sift_command("search", "green tea leaves", "--index", INDEX, "--rerank", "--trace"),
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    shown = " ".join(done.stdout.split())
    assert "attempts: #1 malformed" in shown and "#3 malformed" in shown, shown
    assert "failed: malformed" in shown and "fallback:" not in shown, shown
    assert "error: search" in done.stderr and "error: search" not in done.stdout


def test_a_failed_batch_item_reports_its_billed_usage(stack: Stack, corpus: object) -> None:
    before = stack.model.usage()
    stack.model.script([malformed("still not json")] * 3)
    body = {"index": INDEX, "rerank": True, "queries": [{"id": "q1", "query": "green tea"}]}
    batch = stack.live.post("/v1/batches", json=body, headers=ACME).json()
    deadline = time.monotonic() + 30
    while not batch["finished_at"] and time.monotonic() < deadline:
        time.sleep(0.1)
        batch = stack.live.get(f"/v1/batches/{batch['id']}", headers=ACME).json()
    billed = _delta(stack.model.usage(), before)
    [item] = stack.live.get(f"/v1/batches/{batch['id']}/results", headers=ACME).json()["results"]
    assert item["status"] == "failed", item
    usage = item["error"]["usage"]
    assert usage["requests"] == 3 and billed["input_tokens"] > 0
    assert {name: usage[name] for name in USAGE_FIELDS} == billed


def test_a_failure_before_any_model_call_has_no_usage(stack: Stack, corpus: object) -> None:
    response = stack.live.post(
        "/v1/searches",
        params={"wait": 10},
        json={"index": "no-such-index", "query": "tea", "rerank": True},
        headers=ACME,
    )
    job = response.json()
    assert job["status"] == "failed", job
    assert job["error"]["usage"] is None


def test_a_search_the_rate_budget_never_let_call_the_model_has_no_usage(
    stack: Stack, corpus: object
) -> None:
    """A 429's pause (a minute, another process's) outlasts the 30 s deadline: the only
    attempt is ``budget_exhausted``, nothing is sent, and the search fails ``rerank_failed``
    (``fail_closed``). No model call was made: its ``error.usage`` is ``null``, on the search
    and in its webhook's body, as for a failure before the rerank (a batch item's error is
    made by the same ``error_info``: tests/unit/test_task_errors.py). It was a usage of 0
    requests, priced at $0, as if a call had been made and cost nothing."""
    client = redis.Redis.from_url(stack.redis_url + "/0")
    try:
        RedisRateBudget(client, MODEL).pause(60.0)
    finally:
        client.close()
    # a worker process with no limit known reads the shared hash at most this often: one that
    # read it just before the pause (the last test's calls) sees it after this, not before
    time.sleep(OFF_REFRESH_SECONDS)
    received = stack.model.counts()["received"]
    with webhook_inbox() as (url, inbox):
        body = {"index": INDEX, "query": "green tea", "rerank": True, "webhook_url": url}
        response = stack.live.post("/v1/searches", params={"wait": 20}, json=body, headers=ACME)
        job = response.json()
        assert job["status"] == "failed", job
        delivered, headers = inbox.get(timeout=60)
    payload = Webhook(KEYS[0]["webhook_secret"]).verify(delivered, headers)
    assert stack.model.counts()["received"] == received  # no call reached the model
    assert job["error"]["type"] == "rerank_failed"
    assert "budget_exhausted" in job["error"]["message"]
    assert job["error"]["usage"] is None
    assert payload["data"]["usage"] is None and payload["data"]["error"]["type"] == "rerank_failed"


def _unread(stack: Stack) -> tuple[float, float]:
    """The live worker's standard-lane attempts possibly billed and not read, and their
    estimated input tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack.worker_metrics_url, timeout=10).text
    found = {"sift_rerank_unread_attempts_total": 0.0, "sift_rerank_unread_input_tokens_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found and sample.labels.get("lane") == "standard":
                found[sample.name] += sample.value
    return found["sift_rerank_unread_attempts_total"], found[
        "sift_rerank_unread_input_tokens_total"
    ]


def test_a_call_cut_off_after_it_was_sent_is_counted_as_possibly_billed(
    stack: Stack, corpus: object
) -> None:
    """The provider answers the first call and the connection breaks mid-answer: it billed
    the call, and no usage of it was read, so the job's usage and the token counters leave it
    out (docs/observability.md). The worker counts it as an unread attempt with its prompt's
    estimated input tokens; nothing counted it before."""
    attempts, tokens = _unread(stack)
    before = stack.model.usage()
    stack.model.script([cut(), good()])
    job = _search(stack.live, "green tea leaves")
    assert job["status"] == "succeeded", job
    billed = stack.model.usage()["responses"] - before["responses"]
    usage = job["result"]["usage"]
    assert billed == 2 and usage["requests"] == 2  # the cut call is a request with no usage
    after_attempts, after_tokens = _unread(stack)
    assert after_attempts - attempts == 1
    assert after_tokens - tokens > 0


@dataclass
class Unpriced:
    client: httpx.Client
    metrics_url: str
    worker_log: Path
    log_when_ready: str  # the worker's log once it was ready, before any job ran


@pytest.fixture(scope="module")
def unpriced(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unpriced]:
    """A worker and gateway on database 2 of the stack's Redis whose price table lacks the
    model (SIFT_PRICES replaces the built-in one), against the same fake Messages API."""
    tmp = tmp_path_factory.mktemp("unpriced")
    metrics_port = free_port()
    port = {"SIFT_WORKER_METRICS_PORT": str(metrics_port)}
    with unpriced_stack(stack, tmp, 2, **port) as (client, when_ready):
        log = tmp / "w" / "unpriced.log"
        yield Unpriced(client, f"http://127.0.0.1:{metrics_port}/metrics", log, when_ready)


def _unpriced_calls(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    name = f'sift_rerank_unpriced_calls_total{{lane="standard",model="{MODEL}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_model_with_no_price_warns_at_start_up(unpriced: Unpriced) -> None:
    # the log as it was before any job ran on this worker: the warning came at start-up
    warnings = [line for line in unpriced.log_when_ready.splitlines() if "no price" in line]
    assert len(warnings) == 1, warnings
    assert MODEL in warnings[0] and "SIFT_PRICES" in warnings[0]


def test_a_model_with_no_price_shows_cost_null_and_is_counted(
    stack: Stack, unpriced: Unpriced
) -> None:
    before = _unpriced_calls(unpriced.metrics_url)
    stack.model.script([positions([2, 1])])
    job = _search(unpriced.client, "green tea")
    assert job["status"] == "succeeded", job
    usage = job["result"]["usage"]
    assert usage["requests"] == 1 and usage["input_tokens"] > 0
    assert "cost_usd" in usage and usage["cost_usd"] is None
    assert _unpriced_calls(unpriced.metrics_url) == before + 1
    # a search that made no model call cost nothing, which is known: 0.0, not null
    plain = unpriced.client.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": INDEX, "query": "green tea", "rerank": False},
        headers=ACME,
    ).json()
    assert plain["status"] == "succeeded", plain
    assert plain["result"]["usage"]["cost_usd"] == 0.0
    warnings = [line for line in unpriced.worker_log.read_text().splitlines() if "no price" in line]
    assert len(warnings) == 1  # once, not per search


def test_a_batch_with_an_unpriced_call_has_an_unknown_cost(unpriced: Unpriced) -> None:
    # items reranked by a model with no price: the batch's tokens add up, its cost is
    # unknown (null), not the 0.0 the unpriced calls would add
    queries = [{"id": "a", "query": "green tea"}, {"id": "b", "query": "tea leaves"}]
    body = {"index": INDEX, "rerank": True, "queries": queries}
    batch, results = finished_batch(unpriced.client, body)
    usages = [r["result"]["usage"] for r in results["results"]]
    assert [u["cost_usd"] for u in usages] == [None, None]
    assert batch["usage"]["requests"] == 2
    assert batch["usage"]["input_tokens"] == sum(u["input_tokens"] for u in usages) > 0
    assert batch["usage"]["cost_usd"] is None
    assert batch["rerank_outcomes"] == {"applied": 2, "fallback": 0, "skipped": 0}


def test_a_batchs_items_cost_what_the_counters_rose_by(stack: Stack, corpus: object) -> None:
    """A batch over the real stack, every item's usage on every path it can end on: applied,
    retried after a billed malformed answer, after a 529, a valid answer with no usable rank,
    a 400 (failed at once under fail_closed) and three billed malformed answers (failed, its
    error's usage), with cache tokens on every answer. The items' tokens and dollars summed
    equal what the fake billed, and what the worker's counters rose by."""
    queries = ["green tea", "coffee beans", "black tea", "herbal infusion", "espresso", "matcha"]
    stack.model.configure(cache_read_input_tokens=300, cache_creation_input_tokens=40)
    try:
        before_fake, before_metrics = stack.model.usage(), worker_usage(stack, "standard")
        stack.model.script(
            [malformed("nope"), positions([99]), status(529), status(400)]
            + [malformed("still nope")] * 3
        )
        items = [{"id": f"q{i}", "query": q} for i, q in enumerate(queries)]
        body = {"index": INDEX, "rerank": True, "queries": items}
        batch = stack.live.post("/v1/batches", json=body, headers=ACME).json()
        deadline = time.monotonic() + 60
        while not batch["finished_at"]:
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
            batch = stack.live.get(f"/v1/batches/{batch['id']}", headers=ACME).json()
        results = stack.live.get(f"/v1/batches/{batch['id']}/results", headers=ACME).json()[
            "results"
        ]
        billed = _delta(stack.model.usage(), before_fake)
        after_metrics = worker_usage(stack, "standard")
    finally:
        stack.model.configure(cache_read_input_tokens=0, cache_creation_input_tokens=0)
    assert {r["status"] for r in results} == {"succeeded", "failed"}, results
    usages = [
        (r.get("result") or {}).get("usage") or (r.get("error") or {}).get("usage") or {}
        for r in results
    ]
    summed = {name: sum(u.get(name, 0) for u in usages) for name in USAGE_FIELDS}
    assert summed == billed and billed["cache_read_input_tokens"] > 0
    kinds = {
        "input_tokens": "input",
        "output_tokens": "output",
        "cache_read_input_tokens": "cache_read",
        "cache_creation_input_tokens": "cache_creation",
    }
    for name, kind in kinds.items():
        assert after_metrics[kind] - before_metrics.get(kind, 0.0) == billed[name], kind
    items_cost = sum(u["cost_usd"] for u in usages if u)
    expected = cost_usd(TokenUsage(**billed), price_for(MODEL, DEFAULT_PRICES))
    assert items_cost == pytest.approx(expected)
    counted = after_metrics["cost_usd"] - before_metrics.get("cost_usd", 0.0)
    assert counted == pytest.approx(items_cost)
    # the batch's own record tells the same: its usage is its items' summed (a failed item's
    # billed attempts included), and it counts how each succeeded item was ranked
    assert {name: batch["usage"][name] for name in USAGE_FIELDS} == summed
    assert batch["usage"]["requests"] == sum(u.get("requests", 0) for u in usages) > 0
    assert batch["usage"]["cost_usd"] == pytest.approx(items_cost)
    ranked = [r["result"]["rerank"] for r in results if r["status"] == "succeeded"]
    assert batch["rerank_outcomes"] == {
        "applied": sum(1 for r in ranked if r["applied"]),
        "fallback": sum(1 for r in ranked if not r["applied"] and r["fallback_reason"]),
        "skipped": sum(1 for r in ranked if not r["applied"] and not r["fallback_reason"]),
    }
    assert batch["rerank_outcomes"]["applied"] > 0 and batch["rerank_outcomes"]["fallback"] > 0


def test_a_batch_made_before_its_totals_were_kept_shows_them_unknown(stack: Stack) -> None:
    """A batch an older Sift made (its record has no ``totals`` marker) that a newer worker
    finishes: its items finished before the upgrade were never added to its totals, so the
    totals (``usage``, ``cost_usd`` in it, ``rerank_outcomes``, ``stage_seconds``) are
    ``null`` on its ``GET`` and its listing entry, not a sum that looks known (a zero, or
    the items finished after the upgrade alone). A batch made now shows them."""
    from worker.constants import BATCH_KEY
    from worker.contract import RerankInfo, SearchResult, SearchSpec, Usage
    from worker.queue.jobstore import JobStore

    store = JobStore.from_url(stack.redis_url + "/0")
    try:
        items = [(f"q{i}", SearchSpec(index=INDEX, query="tea")) for i in range(2)]
        old = store.create_batch("acme", INDEX, items)  # no task messages: nothing runs it
        store.redis.hdel(BATCH_KEY + old.id, "totals")  # as the older release wrote it
        result = SearchResult(
            hits=[], rerank=RerankInfo(applied=False), usage=Usage(requests=1, cost_usd=0.001)
        )
        for qid, _ in items[1:]:  # q0 finished before the upgrade, q1 after it
            assert store.start_item(old.id, qid)
            assert store.finish_item(old.id, qid, result=result).applied
        got = stack.live.get(f"/v1/batches/{old.id}", headers=ACME).json()
        totals = ("usage", "rerank_outcomes", "stage_seconds", "failures", "rerank_failures")
        assert [got[name] for name in totals] == [None] * 5, got
        listed = stack.live.get("/v1/batches", headers=ACME).json()
        (entry,) = [b for b in listed["batches"] if b["id"] == old.id]
        assert entry["usage"] is None
        new = store.create_batch("acme", INDEX, items)
        got = stack.live.get(f"/v1/batches/{new.id}", headers=ACME).json()
        assert got["usage"]["cost_usd"] == 0.0 and got["rerank_outcomes"]["applied"] == 0, got
        assert (got["failures"], got["rerank_failures"]) == ({}, {}), got
    finally:
        store.close()
