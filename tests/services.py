"""The real processes the tests start: a private redis-server, Celery workers, the gateway.

They are the ones ``sift up`` starts (:mod:`worker.processes.stack`), with the parent's ``SIFT_*``
variables left out so each test says exactly what it sets.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from subprocess import Popen
from typing import Any, TypeVar

import httpx
import redis

from worker.processes.stack import (
    child_env,
    free_port,
    gateway_process,
    gateway_ready,
    redis_server,
    sift_command,
    stop,
    wait_until,
    worker_process,
)

__all__ = [
    "SHUTDOWN_POLL_SECONDS",
    "Received",
    "celery_worker",
    "free_port",
    "gateway",
    "http_get",
    "killable_gateway",
    "purge",
    "purged",
    "redis_server",
    "stop",
    "unable_to_persist",
    "webhook_inbox",
]


@contextlib.contextmanager
def celery_worker(
    tmp: Path,
    env: Mapping[str, str],
    name: str,
    concurrency: int = 32,
    pool: str = "threads",
    processes: int = 1,
    queues: str | None = None,
) -> Iterator[Popen[bytes]]:
    """``sift worker``: one Celery worker process, or ``processes`` under a supervisor; its
    data dir in ``tmp`` unless ``env`` names one (never the checkout's ``.sift/data``);
    consuming every queue, or ``queues`` (comma-separated)."""
    env = {"SIFT_DATA_DIR": str(tmp / "data"), **env}
    with worker_process(
        tmp, child_env(env, inherit_sift=False), name, concurrency=concurrency, pool=pool,
        processes=processes, queues=queues,
    ) as proc:  # fmt: skip
        yield proc


@contextlib.contextmanager
def unable_to_persist(client: redis.Redis) -> Iterator[None]:
    """The server refusing every write with ``MISCONF``, as when its disk is full, until set
    back on leaving: a save point set (stop-writes-on-bgsave-error, on by default, holds
    only then) and a BGSAVE that fails, its snapshot's name taken by a directory, so the
    rename of the written file onto it fails (Redis 7 lets no client move ``dir``). A full
    disk's failed AOF write is refused with the same ``MISCONF``."""
    blocker = Path(client.config_get("dir")["dir"]) / client.config_get("dbfilename")["dbfilename"]
    (blocker / "held").mkdir(parents=True)
    client.config_set("save", "3600 1")
    client.bgsave()
    for _ in range(500):  # the fork's end, polled (a few ms)
        persistence = client.info("persistence")
        if not persistence["rdb_bgsave_in_progress"]:
            break
        time.sleep(0.01)
    try:
        assert persistence["rdb_last_bgsave_status"] == "err", persistence
        yield
    finally:
        client.config_set("save", "")
        shutil.rmtree(blocker)


@contextlib.contextmanager
def gateway(
    tmp: Path, env: Mapping[str, str], name: str = "gateway", port: int | None = None
) -> Iterator[str]:
    with gateway_process(tmp, child_env(env, inherit_sift=False), name, port=port) as url:
        yield url


@contextlib.contextmanager
def killable_gateway(
    tmp: Path, env: Mapping[str, str], name: str = "gateway", port: int | None = None
) -> Iterator[tuple[Popen[bytes], str]]:
    """``sift gateway`` as :func:`gateway` starts it (on ``port``, or a free one), with its
    process, for a test to kill; SIGKILLed when the block ends if it still runs."""
    port = port or free_port()
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            sift_command("gateway", "--host", "127.0.0.1", "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(env, inherit_sift=False),
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: gateway_ready(port), name, proc, log)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@functools.cache
def _tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def http_get(url: str, *, timeout: float, **options: Any) -> httpx.Response:
    """``httpx.get``, for a check a test polls (a probe, a worker's ``/metrics``): its client
    is made on one TLS context for the whole process, where ``httpx.get`` makes one from the
    CA bundle at every call, about 20 ms of CPU."""
    with httpx.Client(timeout=timeout, verify=_tls()) as client:
        return client.get(url, **options)


def purge(env: Mapping[str, str], tenant: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``sift tenant purge <tenant> --yes`` as its own process, on ``env``'s settings only."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", tenant, "--yes", *args],
        env=child_env({**env, "COLUMNS": "200", "NO_COLOR": "1"}, inherit_sift=False),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def purged(output: str) -> dict[str, int]:
    """The purge's table of what it removed: each row's count by its label."""
    rows = re.findall(r"│\s*([a-zA-Z][^│]*?)\s*│\s*(\d+)\s*│", output)
    return {label: int(count) for label, count in rows}


Received = tuple[bytes, dict[str, str]]


def webhook_figures(job: Mapping[str, Any]) -> dict[str, Any]:
    """What a job's webhook body's ``data`` must be, from the job as its ``GET`` answers: a
    batch's id, status, counts, usage, rerank outcomes and failures by kind (no results); a
    search's id, status, usage (its result's, or its error's) and error type and reason (no
    hits)."""
    if "counts" in job:  # a batch
        shown = ["id", "status", "counts", "usage", "rerank_outcomes"]
        shown += ["failures", "rerank_failures"]
        return {name: job[name] for name in shown}
    error = job["error"]
    usage = job["result"]["usage"] if job["result"] else error and error["usage"]
    return {
        "id": job["id"],
        "status": job["status"],
        "usage": usage,
        "error": error and {k: error[k] for k in ("type", "reason") if k in error},
    }


@contextlib.contextmanager
def webhook_inbox() -> Iterator[tuple[str, queue.Queue[Received]]]:
    """A local webhook receiver answering 204; yields its URL and the (body, headers) queue."""
    inbox: queue.Queue[Received] = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            inbox.put((body, {k.lower(): v for k, v in self.headers.items()}))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with served(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", inbox


_Server = TypeVar("_Server", bound=ThreadingHTTPServer)

# How often a served server's loop looks for its shutdown: ``shutdown()`` waits for that look,
# and at socketserver's default (0.5 s) every receiver and proxy took half a second to stop.
SHUTDOWN_POLL_SECONDS = 0.05


@contextlib.contextmanager
def served(server: _Server) -> Iterator[_Server]:
    """``server`` answering on a thread of its own until the block ends, then shut and closed
    (a test's proxy in front of the gateway, a webhook receiver)."""
    thread = threading.Thread(
        target=server.serve_forever, args=(SHUTDOWN_POLL_SECONDS,), daemon=True
    )
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
