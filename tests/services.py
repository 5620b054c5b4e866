"""Test helpers that start real processes: a private redis-server, a Celery worker, the gateway.

Each one runs in its own temp dir on a free loopback port and is stopped by its id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _wait_until(
    check: object, what: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(Exception):
            if check():  # type: ignore[operator]
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A redis-server of our own (no persistence), yielding its URL."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(tmp),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"redis://127.0.0.1:{port}"
    try:

        def ping() -> bool:
            client = redis.Redis.from_url(url)
            try:
                return bool(client.ping())
            finally:
                client.close()

        _wait_until(ping, "redis-server", proc, log)
        yield url
    finally:
        _stop(proc)


def _env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


@contextlib.contextmanager
def celery_worker(
    tmp: Path, env: Mapping[str, str], name: str, concurrency: int = 32, pool: str = "threads"
) -> Iterator[subprocess.Popen[bytes]]:
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"worker-{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "worker.celery_app",
                "worker",
                "--pool",
                pool,
                "--concurrency",
                str(concurrency),
                "-n",
                f"{name}@%h",
                "-Q",
                "sift.search,sift.batch,sift.ingest,sift.webhooks",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "INFO",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env({**env, "SIFT_WORKER_POOL": pool}),
            cwd=REPO,
        )
    try:
        _wait_until(lambda: b" ready." in log.read_bytes(), f"worker {name}", proc, log)
        yield proc
    finally:
        _stop(proc)


@contextlib.contextmanager
def gateway(
    tmp: Path, env: Mapping[str, str], name: str = "gateway", workers: int = 1
) -> Iterator[str]:
    """The gateway under uvicorn, yielding its base URL."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "api_gateway.app:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--no-access-log",
                "--workers",
                str(workers),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(env),
            cwd=REPO,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            return httpx.get(url + "/readyz", timeout=1).status_code == 200

        _wait_until(healthy, name, proc, log)
        yield url
    finally:
        _stop(proc)
