"""The real processes the tests start: a private redis-server, Celery workers, the gateway.

They are the ones ``sift up`` starts (:mod:`worker.stack`), with the parent's ``SIFT_*``
variables left out so each test says exactly what it sets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from subprocess import Popen

from worker.stack import child_env, free_port, gateway_process, redis_server, stop, worker_process

__all__ = ["celery_worker", "free_port", "gateway", "redis_server", "stop"]


@contextlib.contextmanager
def celery_worker(
    tmp: Path, env: Mapping[str, str], name: str, concurrency: int = 32, pool: str = "threads"
) -> Iterator[Popen[bytes]]:
    with worker_process(
        tmp, child_env(env, inherit_sift=False), name, concurrency=concurrency, pool=pool
    ) as proc:
        yield proc


@contextlib.contextmanager
def gateway(
    tmp: Path, env: Mapping[str, str], name: str = "gateway", port: int | None = None
) -> Iterator[str]:
    with gateway_process(tmp, child_env(env, inherit_sift=False), name, port=port) as url:
        yield url
