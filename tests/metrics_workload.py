"""A metrics target for a real Prometheus: forked workers run the real pipeline over fakes.

Run as ``python -m tests.metrics_workload DIR``. The process switches to multiprocess mode in
``DIR``, pre-registers the known series, counts its workers as a ``sift worker`` supervisor
does its processes, serves ``/metrics`` on a free port, and prints ``{"port": N}``. On a
``go`` line on stdin it forks three workers, each running a scripted set of searches through
:class:`SearchPipeline` with :class:`PrometheusRecorder` (one fail_open, one fail_closed, one
in the economy lane: prepare, answer, finish at half the price), marks them dead when they
exit, and prints what the workload did: the usage the fake model handed out, the usage the
results carried, and every attempt class and outcome.
It exits when stdin closes.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from collections import Counter
from dataclasses import replace
from multiprocessing.queues import Queue
from typing import Any

from tests.fakes import FakeEmbedder, InMemoryBackend, ScriptedReranker, Step, fail, reply
from worker.constants import ECONOMY_PRICE_DISCOUNT, INGEST_QUEUE, SEARCH_QUEUE, WEBHOOK_QUEUE
from worker.contract import DocumentIn, SearchSpec
from worker.core.cost import cost_usd, price_for
from worker.core.pipeline import RerankRun, SearchPipeline
from worker.core.tokens import prompt_tokens
from worker.core.types import RerankPrompt, RerankReply, TokenUsage
from worker.errors import AttemptOutcome, RerankAttemptError, SiftError
from worker.observability import metrics
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import DEFAULT_PRICES, load_settings

MODEL = "claude-haiku-4-5"
BACKEND = "memory"
QUEUES = (SEARCH_QUEUE, INGEST_QUEUE, WEBHOOK_QUEUE)
TOPICS = ["volcano eruption ash", "river delta flood", "chess opening theory", "jazz solo"]


def usage(n: int) -> TokenUsage:
    return TokenUsage(
        input_tokens=1000 + 17 * n,
        output_tokens=40 + 3 * n,
        cache_read_input_tokens=200 * n,
        cache_creation_input_tokens=100 if n % 2 else 0,
    )


def error(outcome: AttemptOutcome, used: TokenUsage | None = None) -> RerankAttemptError:
    exc = RerankAttemptError(outcome, "scripted")
    if used is not None:
        exc.usage = used  # type: ignore[attr-defined]  # a malformed answer is still billed
    return exc


class CountingReranker:
    """Tallies the usage the fake model handed out, replies and failed attempts alike, and
    the prompts it was sent and never answered (a timeout, a connection lost): their input
    tokens as estimated before they were sent (the workload meters no rate limit)."""

    def __init__(self, inner: ScriptedReranker) -> None:
        self.inner = inner
        self.model = inner.model
        self.effort = inner.effort
        self.usage: list[TokenUsage] = []
        self.unread: list[int] = []

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        try:
            answer = self.inner.rerank(prompt, timeout_seconds)
        except RerankAttemptError as exc:
            used = getattr(exc, "usage", None)
            if isinstance(used, TokenUsage):
                self.usage.append(used)
            elif exc.sent and exc.outcome in (AttemptOutcome.TIMEOUT, AttemptOutcome.CONNECTION):
                self.unread.append(max(1, round(prompt_tokens(prompt))))
            raise
        self.usage.append(answer.usage)
        return answer


# Each search: its spec overrides, its script, and the attempts and outcome it provokes.
FAIL_OPEN: list[tuple[dict[str, Any], list[Step]]] = [
    ({}, [reply([2, 1], usage(1))]),  # applied
    ({}, [reply([0, 99], usage(2))]),  # fallback_no_valid_ranks
    (
        {},
        [
            fail(error(AttemptOutcome.TIMEOUT)),
            fail(error(AttemptOutcome.RATE_LIMITED)),
            reply([1, 3], usage(3)),
        ],
    ),  # applied after two retries
    ({}, [fail(error(AttemptOutcome.HTTP_4XX))]),  # fallback_error, never retried
    (
        {},
        [fail(error(AttemptOutcome.MALFORMED, usage(4))), reply([1], usage(5))],
    ),  # applied; the malformed answer's usage counts
    ({}, [fail(error(AttemptOutcome.CONNECTION))] * 3),  # fallback_error after 3 attempts
    ({}, [fail(error(AttemptOutcome.REFUSED, usage(8)))]),  # fallback_error, billed, not retried
    ({"mode": "fts", "query": "zzz unmatched"}, []),  # skipped: no candidates
]
# The economy lane: the prompt goes out in a provider batch; its answer comes back to finish().
ECONOMY: list[tuple[dict[str, Any], list[Step]]] = [
    ({}, [reply([3, 1], usage(7))]),  # applied, at half the price, lane="economy"
]
FAIL_CLOSED: list[tuple[dict[str, Any], list[Step]]] = [
    ({}, [fail(error(AttemptOutcome.HTTP_5XX))] * 3),  # failed: the job fails
    ({"rerank": False}, []),  # no rerank asked
    ({"mode": "fts"}, [reply([3], usage(6))]),  # applied
]


def run_worker(
    policy: str,
    searches: list[tuple[dict[str, Any], list[Step]]],
    out: Queue[Any],
    lane: str = "standard",
) -> None:
    """One forked worker: runs its searches as jobs and reports what they did. In the economy
    lane each search runs as prepare, the model's answer (as a provider batch would bring it),
    then finish, at the Message Batches price."""
    settings = load_settings(
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
        rerank_failure_policy=policy,
        generation_max_requests=3,
    )
    fake = CountingReranker(ScriptedReranker([s for _, steps in searches for s in steps], MODEL))
    pipeline = build_pipeline(
        settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=metrics.InFlightReranker(fake),  # type: ignore[arg-type]
        recorder=metrics.PrometheusRecorder(),
        sleep=lambda seconds: None,
    )
    discount = 1.0
    if lane == "economy":
        discount = ECONOMY_PRICE_DISCOUNT
        pipeline = pipeline.variant(
            config=replace(pipeline.config, price_discount=discount),
            recorder=metrics.PrometheusRecorder(lane="economy"),
        )
    runtime = Runtime(pipeline)
    docs = [DocumentIn(id=f"d{i}", text=f"{t} note {i}") for i, t in enumerate(TOPICS * 5)]
    runtime.ingest("docs", "acme", docs)

    result_usage: Counter[str] = Counter()
    result_cost = 0.0
    statuses: Counter[str] = Counter()
    for overrides, _ in searches:
        metrics.observe_queue_wait(SEARCH_QUEUE, 0.02)
        spec = SearchSpec(**{"index": "docs", "query": "volcano ash", "limit": 3, **overrides})
        with metrics.running_job():
            try:
                result = (
                    economy_search(pipeline, fake, spec)
                    if lane == "economy"
                    else runtime.search(spec, "acme")
                )
            except SiftError as exc:
                metrics.job_completed("search", "failed", exc.code)
                statuses["failed:" + exc.code] += 1
                continue
        metrics.job_completed("search", "succeeded")
        statuses["succeeded"] += 1
        for name, value in result.usage.model_dump().items():
            if name == "cost_usd":
                result_cost += value
            else:
                result_usage[name] += value
        metrics.webhook_delivery("delivered")

    price = price_for(MODEL, DEFAULT_PRICES)
    out.put(
        {
            "fake_tokens": {
                "input": sum(u.input_tokens for u in fake.usage),
                "output": sum(u.output_tokens for u in fake.usage),
                "cache_read": sum(u.cache_read_input_tokens for u in fake.usage),
                "cache_creation": sum(u.cache_creation_input_tokens for u in fake.usage),
            },
            "fake_cost": sum(cost_usd(u, price, discount) for u in fake.usage),
            "fake_unread": len(fake.unread),
            "fake_unread_input": sum(fake.unread),
            "result_usage": dict(result_usage),
            "result_cost": result_cost,
            "statuses": dict(statuses),
        }
    )


def economy_search(pipeline: SearchPipeline, fake: CountingReranker, spec: SearchSpec) -> Any:
    prepared = pipeline.prepare(spec, "acme")
    if prepared.result is not None:
        return prepared.result
    assert prepared.prompt is not None
    run = RerankRun()
    answer = fake.rerank(prepared.prompt, 1.0)
    pipeline.record_attempt(run, AttemptOutcome.OK, answer.usage, 1.0)
    run.reply, run.returned, run.seconds = answer, answer.positions, 1.0
    return pipeline.finish(prepared, run)


# What the scripts above provoke, counted by hand: the test checks Prometheus against these.
EXPECTED_ATTEMPTS = {
    "ok": 6,
    "timeout": 1,
    "rate_limited": 1,
    "http_4xx": 1,
    "malformed": 1,
    "refused": 1,
    "connection": 3,
    "http_5xx": 3,
}
EXPECTED_UNREAD = 4  # the timeout and the 3 connections lost: sent, never answered
EXPECTED_OUTCOMES = {
    "applied": 5,
    "fallback_no_valid_ranks": 1,
    "fallback_error": 3,
    "failed": 1,
    "skipped": 1,
}
EXPECTED_SEARCHES = {("hybrid", "ok"): 5, ("hybrid", "fallback"): 4, ("fts", "ok"): 2,
                     ("hybrid", "error"): 1}  # fmt: skip


class FakeRedis:
    """LLEN over fixed list lengths: the backlog the gateway would read from Redis."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths

    def llen(self, name: str) -> int:
        return self.lengths.get(name, 0)


WORKERS = 3  # the workers run_workload forks


def run_workload() -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    out: Queue[Any] = ctx.Queue()
    metrics.job_submitted("search", len(FAIL_OPEN) + len(FAIL_CLOSED) + len(ECONOMY))
    workers = [
        ctx.Process(target=run_worker, args=("fail_open", FAIL_OPEN, out)),
        ctx.Process(target=run_worker, args=("fail_closed", FAIL_CLOSED, out)),
        ctx.Process(target=run_worker, args=("fail_open", ECONOMY, out, "economy")),
    ]
    for worker in workers:
        worker.start()
    reports = [out.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join()
        metrics.mark_process_dead(worker.pid)  # type: ignore[arg-type]
    out.close()
    out.join_thread()
    backlog = metrics.update_backlog(FakeRedis({SEARCH_QUEUE: 7, WEBHOOK_QUEUE: 2}), QUEUES)

    def total(key: str) -> Counter[str]:
        summed: Counter[str] = Counter()
        for report in reports:
            summed.update(report[key])
        return summed

    return {
        "fake_tokens": dict(total("fake_tokens")),
        "fake_cost": sum(r["fake_cost"] for r in reports),
        "fake_unread": sum(r["fake_unread"] for r in reports),
        "fake_unread_input": sum(r["fake_unread_input"] for r in reports),
        "result_usage": dict(total("result_usage")),
        "result_cost": sum(r["result_cost"] for r in reports),
        "statuses": dict(total("statuses")),
        "exit_codes": [w.exitcode for w in workers],
        "backlog": backlog,
    }


def main(directory: str) -> None:
    metrics.setup_multiprocess(directory)
    metrics.preregister(models=[MODEL], backend=BACKEND, queues=QUEUES)
    metrics.worker_processes(WORKERS, WORKERS)  # as a sift worker supervisor says at its start
    server, thread = metrics.start_worker_metrics_server(0, addr="127.0.0.1")
    emit({"port": server.server_address[1]})
    try:
        for line in sys.stdin:
            if line.strip() == "go":
                emit(run_workload())
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
