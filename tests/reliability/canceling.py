"""Cancelling batches on a real stack at default settings: what tests/reliability/test_cancel.py
and benchmarks/bench_cancel.py share.

The stack is the real one (redis-server, one ``sift worker`` on the threads pool at its
default concurrency, the gateway under uvicorn) with the fake Messages API in this process,
scripted to answer each rerank call after 0.3 to 1 s. Batch sizes, chunk sizes, item
concurrency and the rest are Sift's defaults.

    with cancel_stack(tmp) as stack:
        run = submit_and_cancel(stack, total=300, after=0.5)
        run.final["counts"]  # {"canceled": ..., "succeeded": ...}
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.fake_anthropic import FakeAnthropic, delay
from tests.reliability.support import (
    ACME,
    batch_counts,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker, gateway, redis_server
from worker.settings import Settings

# the worker's default thread count (SIFT_WORKER_CONCURRENCY), named so the test says it
DEFAULT_CONCURRENCY = int(Settings.model_fields["worker_concurrency"].default)
MODEL_SECONDS = (0.3, 1.0)  # how long the fake model takes to answer one rerank call


@dataclass
class CancelStack:
    client: httpx.Client
    redis_url: str
    model: FakeAnthropic


@dataclass
class CancelRun:
    """One batch submitted, then canceled: the cancel's answer and the batch once final."""

    batch_id: str
    cancel_status: int
    cancel_body: dict[str, Any]
    final: dict[str, Any]
    model_calls: int

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.final["counts"])


@contextlib.contextmanager
def cancel_stack(tmp: Path) -> Iterator[CancelStack]:
    """Redis, one worker and the gateway at defaults, the sample corpus ingested."""
    with FakeAnthropic() as model, redis_server(tmp / "redis") as url:
        env = stack_env(url + "/0", model.url)
        with (
            gateway(tmp / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp / "w", env, "w", concurrency=DEFAULT_CONCURRENCY),
        ):
            ingest(client)
            yield CancelStack(client, url + "/0", model)


def script_model(model: FakeAnthropic, calls: int, seed: int = 0) -> None:
    """Forget earlier calls; the next ``calls`` answers each take 0.3 to 1 s."""
    model.reset()
    rng = random.Random(seed)
    model.script(delay(rng.uniform(*MODEL_SECONDS)) for _ in range(calls))


def finished(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    """The batch once it has finished (every item final)."""
    wait_for(lambda: batch_counts(client, batch_id)["finished_at"] is not None, "batch finished")
    return batch_counts(client, batch_id)


def cancel(client: httpx.Client, batch_id: str) -> httpx.Response:
    return client.delete(f"/v1/batches/{batch_id}", headers=ACME)


def submit_and_cancel(
    stack: CancelStack,
    total: int,
    after: float = 0.0,
    *,
    once_running: bool = False,
    webhook_url: str | None = None,
    seed: int = 0,
) -> CancelRun:
    """Submit a reranked batch of ``total``, cancel it ``after`` seconds after the gateway
    accepted it (``once_running``: as soon as the worker has started items), and wait until
    it has finished."""
    script_model(stack.model, total, seed)
    batch_id = submit_batch(stack.client, total, webhook_url=webhook_url)
    time.sleep(after)
    if once_running:
        check = stack.client.get
        wait_for(
            lambda: check(f"/v1/batches/{batch_id}", headers=ACME).json()["counts"]["running"] > 0,
            "items running",
            timeout=60,
        )
    response = cancel(stack.client, batch_id)
    final = finished(stack.client, batch_id)
    return CancelRun(
        batch_id, response.status_code, response.json(), final, len(stack.model.requests())
    )
