"""Starts Sift's local processes: a Redis of its own, Celery workers, the gateway.

``sift up``, ``sift demo`` and the end-to-end tests all start the stack through this one
module. Each process runs on a loopback port, logs to a file in its own directory,
and is stopped (SIGTERM, then SIGKILL) when its context ends.

    with redis_server(Path(".sift/redis")) as redis_url:
        with worker_process(dir, env), gateway_process(dir, env) as url:
            ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx
import redis

from worker.errors import ConfigError

READY_TIMEOUT_SECONDS = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM, a grace period, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_until(
    check: Callable[[], object],
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout: float = READY_TIMEOUT_SECONDS,
) -> None:
    """Poll ``check`` until it is true; fail with the log's tail if the process dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready:\n{log.read_text()[-4000:]}")


def child_env(extra: Mapping[str, str], *, inherit_sift: bool = True) -> dict[str, str]:
    """The environment of a child: ours (optionally without ``SIFT_*``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if inherit_sift or not k.startswith("SIFT_")}
    env.update(extra)
    return env


@contextlib.contextmanager
def redis_server(
    directory: Path,
    *,
    port: int | None = None,
    appendonly: bool = False,
    appendfsync: str = "everysec",
) -> Iterator[str]:
    """A redis-server of our own on loopback, yielding its URL (``redis://127.0.0.1:PORT``).

    With ``appendonly`` it keeps an AOF in ``directory`` (fsynced ``appendfsync``: ``always``,
    ``everysec`` or ``no``), so a restart on the same port and directory finds its data."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(
            "redis-server is not installed: run ./scripts/install-services.sh, "
            "or set SIFT_REDIS_URL to a Redis you run"
        )
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = directory / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
             "--save", "", "--appendonly", "yes" if appendonly else "no",
             "--appendfsync", appendfsync,
             "--maxmemory-policy", "noeviction", "--daemonize", "no"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"redis://127.0.0.1:{port}"

    def ping() -> bool:
        client = redis.Redis.from_url(url)
        try:
            return bool(client.ping())
        finally:
            client.close()

    try:
        wait_until(ping, "redis-server", proc, log)
        yield url
    finally:
        stop(proc)


def sift_command(*args: str) -> list[str]:
    """``sift ARGS`` run by this interpreter, whether or not the console script is on PATH."""
    return [sys.executable, "-m", "worker.cli", *args]


@contextlib.contextmanager
def worker_process(
    directory: Path,
    env: Mapping[str, str],
    name: str = "worker",
    *,
    concurrency: int | None = None,
    pool: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """One ``sift worker`` consuming every queue, yielded once Celery says it is ready."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / f"{name}.log"
    args = ["worker", "--name", name]
    if concurrency:
        args += ["--concurrency", str(concurrency)]
    if pool:
        args += ["--pool", pool]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            sift_command(*args), stdout=out, stderr=subprocess.STDOUT, env=dict(env)
        )
    try:
        wait_until(lambda: b" ready." in log.read_bytes(), f"worker {name}", proc, log)
        yield proc
    finally:
        stop(proc)


@contextlib.contextmanager
def gateway_process(
    directory: Path,
    env: Mapping[str, str],
    name: str = "gateway",
    *,
    port: int | None = None,
) -> Iterator[str]:
    """``sift gateway`` on loopback, yielding its base URL once ``/readyz`` answers 200."""
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = directory / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            sift_command("gateway", "--host", "127.0.0.1", "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=dict(env),
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, name, proc, log
        )
        yield url
    finally:
        stop(proc)
