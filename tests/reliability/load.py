"""A headless open-loop load generator and the stack it runs against, shared by
``benchmarks/bench_load.py`` (60 s) and ``tests/reliability/test_load.py`` (10 s).

Searches start on a fixed schedule (``rate`` a second, whatever the answers do), each one
``POST /v1/searches?wait=W`` with rerank on, then polled with ``GET`` until final if ``wait``
ran out. Latency is end to end: from the POST to the final status. A job is lost if the
gateway accepted it (200/202) and it never reached a final state before the generator gave up.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.fake_anthropic import fake_process
from tests.reliability.support import ACME, INDEX, ingest, sample_queries, stack_env
from tests.services import celery_worker, gateway, redis_server

FINAL = {"succeeded", "failed", "canceled"}


@dataclass
class LoadReport:
    rate: float  # asked
    duration: float
    submitted: int = 0  # accepted by the gateway (200 or 202)
    refused: int = 0  # any other answer, or no answer
    final: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)  # seconds, final jobs only
    elapsed: float = 0.0  # from the first POST to the last final answer

    @property
    def lost(self) -> int:
        return self.submitted - self.final

    @property
    def achieved(self) -> float:
        return self.final / self.elapsed if self.elapsed else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        if len(self.latencies) == 1:
            return self.latencies[0]
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[int(q) - 1]

    def summary(self) -> str:
        ms = [self.percentile(q) * 1000 for q in (50, 95, 99)]
        return (
            f"asked {self.rate:g}/s for {self.duration:g} s: submitted {self.submitted}, "
            f"final {self.final} {self.statuses}, refused {self.refused}, lost {self.lost}; "
            f"achieved {self.achieved:.1f}/s; latency p50 {ms[0]:.0f} ms, "
            f"p95 {ms[1]:.0f} ms, p99 {ms[2]:.0f} ms"
        )


async def _one(
    client: httpx.AsyncClient, query: str, wait: float, give_up: float, report: LoadReport
) -> None:
    started = time.monotonic()
    try:
        response = await client.post(
            "/v1/searches",
            params={"wait": wait},
            json={"index": INDEX, "query": query, "limit": 10, "rerank": True},
            headers=ACME,
        )
    except httpx.HTTPError:
        report.refused += 1
        return
    if response.status_code not in (200, 202):
        report.refused += 1
        return
    report.submitted += 1
    job = response.json()
    while job["status"] not in FINAL and time.monotonic() - started < give_up:
        await asyncio.sleep(0.2)
        with contextlib.suppress(httpx.HTTPError):
            polled = await client.get(f"/v1/searches/{job['id']}", headers=ACME)
            if polled.status_code == 200:
                job = polled.json()
    if job["status"] in FINAL:
        report.final += 1
        report.statuses[job["status"]] = report.statuses.get(job["status"], 0) + 1
        report.latencies.append(time.monotonic() - started)


async def run_load(
    base_url: str, *, rate: float, duration: float, wait: float = 20.0, give_up: float = 120.0
) -> LoadReport:
    """Hold ``rate`` searches a second for ``duration`` seconds; answer the report."""
    report = LoadReport(rate=rate, duration=duration)
    queries = sample_queries()
    total = int(rate * duration)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        start = time.monotonic()
        tasks = []
        for i in range(total):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            query = f"{queries[i % len(queries)]} {i}"
            tasks.append(asyncio.create_task(_one(client, query, wait, give_up, report)))
        await asyncio.gather(*tasks)
        report.elapsed = time.monotonic() - start
    return report


@contextlib.contextmanager
def load_stack(tmp: Path, *, model_delay: float, concurrency: int = 64) -> Iterator[str]:
    """redis-server, the fake model as its own process (answering after ``model_delay``),
    one worker (threads pool) and the gateway, with the sample corpus ingested; yields the
    gateway URL."""
    with (
        fake_process(tmp, "--delay", str(model_delay)) as (model_url, _),
        redis_server(tmp / "redis") as url,
    ):
        env = stack_env(url + "/0", model_url, SIFT_SEARCH_DEADLINE_SECONDS="30")
        with (
            celery_worker(tmp / "w", env, "w-load", concurrency=concurrency),
            gateway(tmp / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
        ):
            ingest(client)
            yield base
