"""The model-fault matrix through the real stack, shared by the test and ``bench_faults.py``.

One redis-server, the fake Messages API in-process, and two gateway+worker pairs on separate
Redis databases, one per ``SIFT_RERANK_FAILURE_POLICY``. Each case scripts the fake, submits
one search over HTTP (``?wait=``), and reads back: the job's outcome, the requests the fake
saw, the worker's ``sift_rerank_attempts_total{result=...}`` (scraped from its /metrics), and
the search's measured duration (``finished_at - started_at`` of the job record) against the
deadline.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from tests import fake_anthropic as fa
from tests.reliability.support import ACME, INDEX, forget_rate_budget, ingest, stack_env
from tests.services import celery_worker, free_port, gateway, redis_server
from worker.constants import SEARCH_KEY

# SIFT_SEARCH_DEADLINE_SECONDS: room for three 5xx answers, the breaker between them opening
# for 1 s, then 2 s (worker/adapters/rate_budget: OUTAGE_FIRST_SECONDS, doubled), the third,
# whose search's probe failed, held a second past that opening for other searches to probe
# first (PROBE_POLL_SECONDS)
DEADLINE = 5.0
ATTEMPT_TIMEOUT = 1.5  # SIFT_GENERATION_TIMEOUT_SECONDS: a stall runs into the deadline
MAX_REQUESTS = 3
POLICIES = ("fail_closed", "fail_open")


@dataclass(frozen=True)
class Case:
    """One failure class: what the fake does, and what Sift must make of it."""

    behaviours: list[fa.Behaviour]
    result: str  # the attempt class counted, and named by the error / fallback reason
    attempts: int  # requests the fake must see (0: "at least one", for the deadline cases)
    reason: str | None = None  # the failure's reason when not ``result`` (deadline cases)


# A stall longer than the deadline: the first attempt times out at min(1.5 s, time left),
# the second gets what is left of the 2 s deadline, and the search ends at the deadline.
CASES: dict[str, Case] = {
    "timeout": Case([fa.stall(10)] * 3, "timeout", 0, reason=None),
    # headers at once, then the body a piece at a time for 10 s: no read waits long, but
    # each attempt still ends at its timeout, and the search at the deadline
    "trickle": Case([fa.trickle(10)] * 3, "timeout", 0, reason=None),
    "http_5xx": Case([fa.status(500), fa.status(503), fa.status(500)], "http_5xx", 3),
    "overloaded_529": Case([fa.status(529)] * 3, "http_5xx", 3),
    "rate_limited_429": Case([fa.status(429, retry_after=0.1)] * 3, "rate_limited", 3),
    "connection_drop": Case([fa.drop()] * 3, "connection", 3),
    "connection_cut_mid_body": Case([fa.cut()] * 3, "connection", 3),
    "http_4xx": Case([fa.status(400)], "http_4xx", 1),
    "malformed": Case(
        [fa.malformed("not json"), fa.malformed('{"positions": ["1"]}'), fa.positions([1.5])],
        "malformed",
        3,
    ),
    # the API refuses the same prompt again: one billed attempt, never retried
    "refused": Case([fa.refusal("cyber")], "refused", 1),
}
# A valid answer with no usable position is not a failure: the no_valid_ranks fallback.
NO_VALID_RANKS = [fa.positions([0, 99, 99, -1])]


@dataclass(frozen=True)
class Pair:
    client: httpx.Client
    metrics_url: str
    redis_url: str


@dataclass
class Observation:
    status: str
    error: dict[str, Any] | None
    rerank: dict[str, Any] | None
    requests: int
    counters: dict[str, float]  # attempt result -> increase during the case
    seconds: float  # measured search duration: finished_at - started_at
    usage: dict[str, Any] | None = None  # the job's: its result's, or its error's

    @property
    def overrun_ms(self) -> float:
        return max(0.0, (self.seconds - DEADLINE) * 1000.0)


@dataclass
class FaultStack:
    model: fa.FakeAnthropic
    pairs: dict[str, Pair]


_ATTEMPT = re.compile(r"^sift_rerank_attempts_total\{([^}]*)\}\s+([0-9.eE+-]+)$", re.MULTILINE)


def attempt_counters(metrics_url: str) -> dict[str, float]:
    """``sift_rerank_attempts_total`` by ``result``, summed over models."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for labels, value in _ATTEMPT.findall(text):
        found = re.search(r'result="([^"]+)"', labels)
        if found:
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(value)
    return out


@contextlib.contextmanager
def fault_stack(tmp: Path) -> Iterator[FaultStack]:
    """The redis-server, the fake, and one gateway+worker pair per failure policy."""
    with (
        redis_server(tmp / "redis") as url,
        fa.FakeAnthropic() as model,
        contextlib.ExitStack() as stack,
    ):
        pairs: dict[str, Pair] = {}
        for db, policy in enumerate(POLICIES):
            port = free_port()
            env = stack_env(
                f"{url}/{db}",
                model.url,
                SIFT_RERANK_FAILURE_POLICY=policy,
                SIFT_SEARCH_DEADLINE_SECONDS=str(DEADLINE),
                SIFT_GENERATION_TIMEOUT_SECONDS=str(ATTEMPT_TIMEOUT),
                SIFT_GENERATION_MAX_REQUESTS=str(MAX_REQUESTS),
                SIFT_WORKER_METRICS_PORT=str(port),
                SIFT_TASK_MAX_RETRIES="0",
            )
            stack.enter_context(celery_worker(tmp / "w", env, f"w-{policy}", concurrency=4))
            base = stack.enter_context(gateway(tmp / "g", env, f"g-{policy}"))
            client = stack.enter_context(httpx.Client(base_url=base, timeout=60))
            ingest(client)
            pairs[policy] = Pair(client, f"http://127.0.0.1:{port}/metrics", f"{url}/{db}")
        yield FaultStack(model, pairs)


def _measured_seconds(redis_url: str, job_id: str) -> float:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        started, finished = client.hmget(SEARCH_KEY + job_id, ["started_at", "finished_at"])
    finally:
        client.close()
    assert started and finished, job_id
    return float(finished) - float(started)


def run_case(stack: FaultStack, policy: str, behaviours: list[fa.Behaviour]) -> Observation:
    """Script the fake, run one reranked search through ``policy``'s pair, observe."""
    pair = stack.pairs[policy]
    stack.model.reset()
    forget_rate_budget(pair.redis_url)  # a case's 5xx opened the breaker for the next case
    stack.model.script(behaviours)
    before = attempt_counters(pair.metrics_url)
    response = pair.client.post(
        "/v1/searches",
        params={"wait": 30},
        json={"index": INDEX, "query": "volcano ash", "limit": 5, "rerank": True},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    job = response.json()
    after = attempt_counters(pair.metrics_url)
    counters = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    result = job.get("result") or {}
    return Observation(
        status=job["status"],
        error=job.get("error"),
        rerank=result.get("rerank"),
        requests=len(stack.model.requests()),
        counters=counters,
        seconds=_measured_seconds(pair.redis_url, job["id"]),
        usage=(job.get("result") or job.get("error") or {}).get("usage"),
    )
