"""What the economy lane's reliability tests share: a stack at default settings, its
workers, a submission and its end.

A real stack of the test's own (redis-server, the gateway under uvicorn, ``sift worker``
processes, the fake Messages API on loopback HTTP with the real SDK); every ``SIFT_``
setting at its default (the economy lane's first poll after 30 s, the dead-worker check)
except what a test cannot run without (the Redis URL, the keys, the model's address).

The tests are in several files (test_economy_crash*.py, test_economy_lost_*.py,
test_economy_slow_create.py), not two long ones: ``make test`` runs each file whole on one
pytest-xdist process, so a file of five minute-long tests would run alone at the end.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from celery import Celery

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import batch_counts, stack_env, submit_batch, wait_for
from tests.services import gateway, redis_server
from worker.constants import BATCH_QUEUE
from worker.processes.stack import child_env, worker_process
from worker.queue.config import celery_config
from worker.settings import load_settings

FINISH_WINDOW = 240.0  # from the new worker's start: dead-worker check + a 30 s poll + slack
COUNTING_RUNTIME = "tests.reliability.economy_counting_runtime:build_runtime"


def crash_settings(crashes: Path, after: str | None = None) -> dict[str, str]:
    """Settings of a worker whose economy recorder writes each count into the new folder
    ``crashes`` and kills the worker once, just after its first count (of the attempt class
    ``after``; None: of any)."""
    crashes.mkdir()
    extra = {"SIFT_RUNTIME_FACTORY": COUNTING_RUNTIME, "CRASH_ONCE_DIR": str(crashes)}
    if after is not None:
        extra["CRASH_AFTER_OUTCOME"] = after
    return extra


@contextmanager
def economy_stack(
    tmp_path: Path, model: FakeAnthropic, **extra: str
) -> Iterator[tuple[dict[str, str], httpx.Client]]:
    """redis-server and the gateway, no worker (a test starts and kills its own); ``extra``
    settings over the test environment's, the soft shutdown window at its default."""
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
    """``sift worker`` ``name`` (its log ``directory/<name>.log``) with ``env`` only: no
    ``SIFT_`` setting of the shell running the tests."""
    with worker_process(directory, child_env(env, inherit_sift=False), name) as proc:
        yield proc


def without_model(env: dict[str, str]) -> dict[str, str]:
    """The same worker's settings with rerank turned off and no model."""
    env = {k: v for k, v in env.items() if k != "SIFT_GENERATION_MODEL"}
    return env | {"SIFT_RERANK_ENABLED": "false"}


def batch_queue_control(redis_url: str, directory: Path, name: str, *, consume: bool) -> None:
    """Tell worker ``name`` of :func:`worker`, at run time, to stop consuming the batch queue
    (``celery control cancel_consumer sift.batch``; ``consume``: to consume it again,
    ``add_consumer``), and wait until its log says it did: Celery answers before its
    consumer applies the change."""
    app = Celery("sift-control", set_as_current=False)
    app.config_from_object(celery_config(load_settings(redis_url=redis_url)))
    node = f"{name}@{socket.gethostname()}"
    command = app.control.add_consumer if consume else app.control.cancel_consumer
    done = f"Started consuming from {BATCH_QUEUE}" if consume else f"Canceling queue {BATCH_QUEUE}"
    try:
        replies = command(BATCH_QUEUE, destination=[node], reply=True, timeout=10)
    finally:
        app.close()
    assert [node] == [n for reply in replies for n in reply], replies
    wait_for(lambda: done in worker_log(directory, name), f"{name}: {done}", 30)


def worker_log(directory: Path, name: str) -> str:
    """What worker ``name`` of :func:`worker` has logged so far ('' before it starts)."""
    path = directory / f"{name}.log"
    return path.read_text() if path.exists() else ""


def submit_economy(client: httpx.Client, n: int, webhook_url: str | None = None) -> str:
    """An economy-lane batch of ``n`` sample queries, each result with its trace."""
    return submit_batch(client, n, webhook_url=webhook_url, lane="economy", include_trace=True)


def finished(client: httpx.Client, batch_id: str) -> bool:
    """Whether the batch has ended (its ``finished_at`` set)."""
    return batch_counts(client, batch_id)["finished_at"] is not None
