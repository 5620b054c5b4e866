"""A worker raises its soft limit of open files (``RLIMIT_NOFILE``) to what its settings may
hold at once, as far as the hard limit allows, and says in its log when that is short.

Every model call in flight holds a socket, and so does every Redis connection of its
threads: at a soft limit of 64 (``prlimit --nofile=64``) 117 of 200 reranked searches
failed ``rerank_failed`` (``connection``: "[Errno 24] Too many open files", the provider's
address in the message), with nothing at start to say why (/tmp/exhaust17's p7). A real
``sift worker`` here, started under the limits a test sets before its exec.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.services import redis_server
from worker.processes.stack import child_env, stop, worker_service
from worker.settings import Settings

#: Sets the open-files limits, then becomes the command given after it
LIMITED = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)

#: The settings whose defaults say how many sockets a worker may hold at once
SETTINGS = ("rerank_max_in_flight", "worker_concurrency", "batch_item_concurrency")
#: A worker that reranks: a socket for each model call, a rate budget's Redis connections
MODEL = "anthropic:claude-haiku-4-5"


def soft_limit(pid: int) -> tuple[int, int]:
    """The process's open-files limits, soft and hard, as the kernel holds them."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits)
    assert found, limits
    return int(found[1]), int(found[2])


def started_under(tmp_path: Path, soft: int, hard: int) -> tuple[tuple[int, int], str]:
    """A ``sift worker`` (one process) started with the limits ``soft`` and ``hard``: its
    limits once ready, and its log."""
    with redis_server(tmp_path / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_DATA_DIR": str(tmp_path / "data"),
            "SIFT_GENERATION_MODEL": MODEL,
            "ANTHROPIC_API_KEY": "sk-ant-test",
        }
        # at the default settings: the worker_service's one process, no --concurrency
        service = worker_service(tmp_path, child_env(env, inherit_sift=False))
        service.command = [sys.executable, "-c", LIMITED, str(soft), str(hard), *service.command]
        assert service.log is not None
        proc = service.start()
        try:
            service.wait_ready()
            limits = soft_limit(proc.pid)
        finally:
            stop(proc, service.stop_timeout)
    return limits, service.log.read_text(errors="replace")


def test_a_worker_raises_its_soft_limit_to_what_its_settings_may_hold(tmp_path: Path) -> None:
    (soft, hard), log = started_under(tmp_path, soft=64, hard=4096)
    # a socket for each model call in flight, a Redis connection for each thread in the job
    # store's pool and another in the rate budget's
    rerank, threads, items = (Settings.model_fields[name].default for name in SETTINGS)
    at_least = rerank + 2 * (threads + items)
    assert at_least <= soft < hard, (soft, log[-3000:])
    assert f"raised from 64 to {soft}" in log, log[-3000:]
    assert "short" not in log, log[-3000:]


def test_a_worker_whose_hard_limit_is_short_starts_and_says_what_it_needs(
    tmp_path: Path,
) -> None:
    (soft, hard), log = started_under(tmp_path, soft=64, hard=256)
    assert (soft, hard) == (256, 256), log[-3000:]  # as far as it may
    assert "raised from 64 to 256" in log, log[-3000:]
    said = [line for line in log.splitlines() if "WARNING" in line and "open files" in line]
    assert len(said) == 1, log[-3000:]
    warning = said[0]
    assert "is 256 (hard 256)" in warning, warning
    for name in ("RLIMIT_NOFILE", *(f"SIFT_{name.upper()}" for name in SETTINGS)):
        assert name in warning, warning
