"""A metrics target for the rate-limit panels: real searches against the fake Messages API's
limits, through the real SDK, the real shared budget on a real redis-server.

Run as ``python -m tests.rate_limit_workload DIR REDIS_URL MODEL_URL RPM``. The process switches
to multiprocess mode in ``DIR``, pre-registers the known series, serves ``/metrics`` on a free
port and prints ``{"port": N}``. Then, one command per stdin line, each answered with a JSON
line:

- ``flood N``: N searches from 8 threads with no rate budget (each process on its own, as
  with ``SIFT_RATE_BUDGET_ENABLED=false``): beyond the fake's bucket they are answered 429;
- ``metered N``: N searches from 8 threads drawing on the shared budget, set to the fake's
  own RPM: they wait for it, and what the fake's headers say its bucket holds (the flood
  emptied it) lowers Sift's. Answers how many model calls were sent and how many searches
  waited.

It exits when stdin closes.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import redis

from tests.fakes import FakeEmbedder, InMemoryBackend
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.rate_budget import RedisRateBudget
from worker.contract import DocumentIn, SearchSpec
from worker.core.pipeline import SearchPipeline
from worker.observability import metrics
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import RateLimit, load_settings

MODEL = "claude-haiku-4-5"
THREADS = 8


def pipeline(model_url: str, budget: RedisRateBudget | None) -> SearchPipeline:
    settings = load_settings(
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
        rerank_failure_policy="fail_open",
        search_deadline_seconds=30.0,
        generation_timeout_seconds=10.0,
    )
    sdk = anthropic.Anthropic(base_url=model_url, api_key="sk-test", max_retries=0)
    reranker = AnthropicReranker(MODEL, client=sdk, on_headers=budget.learn if budget else None)
    built = build_pipeline(
        settings,
        reranker=metrics.InFlightReranker(reranker),  # type: ignore[arg-type]
        recorder=metrics.PrometheusRecorder(),
        rate_budget=budget,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
    )
    docs = [DocumentIn(id=f"d{i}", title=f"n {i}", text=f"volcano ash {i}") for i in range(20)]
    Runtime(built).ingest("docs", "acme", docs)
    return built


def run(built: SearchPipeline, n: int) -> list[dict[str, Any]]:
    spec = SearchSpec(index="docs", query="volcano ash", limit=5, include_trace=True)
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(lambda _: built.search(spec, "acme"), range(n)))
    return [attempt for r in results for attempt in (r.trace or {}).get("attempts", [])]


def main(directory: str, redis_url: str, model_url: str, rpm: int) -> None:
    metrics.setup_multiprocess(directory)
    metrics.preregister(models=[MODEL])
    server, thread = metrics.start_worker_metrics_server(0, addr="127.0.0.1")
    emit({"port": server.server_address[1]})
    client = redis.Redis.from_url(redis_url)
    try:
        for line in sys.stdin:
            command, _, count = line.strip().partition(" ")
            if command == "flood":
                attempts = run(pipeline(model_url, None), int(count))
                emit({"sent": len(attempts)})
            elif command == "metered":
                budget = RedisRateBudget(client, MODEL, RateLimit(rpm=rpm))
                attempts = run(pipeline(model_url, budget), int(count))
                waits = [
                    a["budget_wait_seconds"] for a in attempts if a["outcome"] != "budget_exhausted"
                ]
                emit({"sent": len(waits), "waited": sum(1 for w in waits if w > 0.001)})
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        client.close()


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
