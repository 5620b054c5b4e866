"""``sift worker`` and ``sift gateway`` started without ``SIFT_REDIS_URL``: one line naming it,
exit 2, as every other bad setting is, and nothing started.

Before, ``sift worker`` (one process per core by default) started its processes, each of
which died on a ``ConfigError`` traceback, and its supervisor started them again, with a
back-off, for as long as it ran; ``sift gateway`` printed uvicorn's traceback of the app's
start-up. Real processes, as a newcomer runs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from typer.testing import CliRunner

from tests import redis6
from tests.keys import ACME, ACME_KEY
from tests.redis6 import proxy_saying_version_6
from tests.services import http_get
from worker.cli import app
from worker.processes.stack import (
    Service,
    child_env,
    free_port,
    gateway_process,
    gateway_service,
    redis_server,
    sift_command,
    stop,
    wait_until,
    worker_service,
)

SIFT = str(Path(sys.executable).with_name("sift"))
_OLD = "whsec_YWNtZS1zZWNyZXQtMDEyMzQ1Njc4OQ=="
_NEW = "whsec_bmV3LWFjbWUtc2VjcmV0LTk4NzY1NDMyMQ=="


@pytest.mark.parametrize(
    "args",
    [["worker", "--processes", "2"], ["worker", "--processes", "1"], ["gateway", "--port"]],
)
def test_no_redis_url_is_one_line_naming_it(tmp_path: Path, args: list[str]) -> None:
    if args[-1] == "--port":
        args = [*args, str(free_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0", COLUMNS="200")
    ran = subprocess.run(
        [SIFT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert "SIFT_REDIS_URL" in said and "Traceback" not in said, said
    assert "restarting" not in said, said


@pytest.mark.parametrize(
    "args",
    [["worker", "--processes", "2"], ["worker", "--processes", "1"], ["gateway", "--port"]],
)
@pytest.mark.parametrize(
    ("keys", "named"),
    [
        (None, "SIFT_API_KEYS_FILE"),  # the file is not there
        (
            '[{"key": "short", "tenant": "t", "webhook_secret": "whsec_c2VjcmV0"}]',
            "entry 0, field key",
        ),
        (  # one tenant, two secrets (a rotation applied to one entry of two): the worker
            # signed with the first entry's, and a receiver holding the other refused them all
            json.dumps(
                [
                    {"key": "acme-key-0001", "tenant": "acme", "webhook_secret": _OLD},
                    {
                        "key": "acme-key-0002",
                        "tenant": "acme",
                        "webhook_secret": _NEW,
                        "webhook_secret_previous": _OLD,
                    },
                ]
            ),
            "SIFT_API_KEYS, SIFT_API_KEYS_FILE: tenant 'acme' is given different webhook "
            "secrets by entries 0 and 1",
        ),
    ],
)
def test_an_api_keys_file_it_cannot_use_is_one_line_naming_it(
    tmp_path: Path, args: list[str], keys: str | None, named: str
) -> None:
    """Before, ``sift gateway`` printed a 166-line traceback of the app factory's
    ``ConfigError`` (exit 1), and ``sift worker`` started and ran on, every webhook raising
    on the file when it came to be signed. A file giving one tenant two webhook secrets was
    refused by the gateway only: the worker started and signed with the first entry's."""
    if args[-1] == "--port":
        args = [*args, str(free_port())]
    path = tmp_path / "keys.json"
    if keys is not None:
        path.write_text(keys)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0", COLUMNS="200")
    env.update(SIFT_REDIS_URL="redis://127.0.0.1:9/0", SIFT_API_KEYS_FILE=str(path))
    ran = subprocess.run(
        [SIFT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert named in said and "Traceback" not in said, said
    assert len(said.strip().splitlines()) == 1, said
    assert _OLD not in said and _NEW not in said, said  # no secret quoted


@pytest.mark.parametrize("processes", ["1", "2"])
@pytest.mark.parametrize("setting", ["SIFT_DATA_DIR", "SIFT_MODEL_CACHE_DIR"])
def test_a_folder_it_cannot_make_is_one_line_naming_it(
    tmp_path: Path, setting: str, processes: str
) -> None:
    """A folder ``sift worker`` cannot make (a path under a file). ``SIFT_DATA_DIR``: the
    embedded backend's check at start made it, and ``mkdir``'s ``FileNotFoundError`` was no
    ``SiftError``: a traceback of 104 lines, exit 1, where a data dir of another schema is one
    line, exit 2. ``SIFT_MODEL_CACHE_DIR`` (the int8 embedding graph is made there at each
    process's warm-up): it only logged "warm-up failed, the first job will try again", and
    the worker ran on, each job meeting the same error."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0", COLUMNS="200")
    env.update(SIFT_REDIS_URL="redis://127.0.0.1:9/0")
    env[setting] = str(blocker / "folder")
    ran = subprocess.run(
        [SIFT, "worker", "--processes", processes],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert f"{setting} ({blocker / 'folder'})" in said and "Traceback" not in said, said
    assert len(said.strip().splitlines()) == 1, said


@pytest.mark.parametrize("processes", ["1", "2"])
@pytest.mark.parametrize("where", ["a file", "under a file", "under /proc"])
def test_a_metrics_folder_it_cannot_use_is_one_line_naming_it(
    tmp_path: Path, where: str, processes: str
) -> None:
    """``PROMETHEUS_MULTIPROC_DIR`` naming a file, or a folder that cannot be made: the
    metrics files' set-up made it, and its ``OSError`` was a traceback of 49 lines, exit 1."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = {"a file": blocker, "under a file": blocker / "folder"}.get(
        where, Path("/proc/sift-metrics")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0", COLUMNS="200")
    env.update(SIFT_REDIS_URL="redis://127.0.0.1:9/0", PROMETHEUS_MULTIPROC_DIR=str(folder))
    ran = subprocess.run(
        [SIFT, "worker", "--processes", processes],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert f"PROMETHEUS_MULTIPROC_DIR ({folder})" in said and "Traceback" not in said, said
    assert len(said.strip().splitlines()) == 1, said


@pytest.mark.parametrize(
    "args", [["worker", "--processes", "1"], ["worker", "--processes", "2"], ["up", "--port"]]
)
def test_a_database_redis_does_not_have_is_one_line_naming_it(
    tmp_path: Path, args: list[str]
) -> None:
    """``SIFT_REDIS_URL=redis://…/99`` on a Redis of 16 databases: Redis refuses each
    connection's SELECT, which only the URL mends. ``sift worker`` took it for a Redis not up
    yet, and Celery tried again ("DB index is out of range") up to 100 times, its liveness and
    re-drive logging the same refusal; ``sift up`` ran its worker so, for as long as it ran."""
    if args[-1] == "--port":
        args = [*args, str(free_port()), "--metrics-port", "0", "--data-dir", str(tmp_path / "d")]
    with redis_server(tmp_path / "redis") as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
        env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0")
        env.update(SIFT_REDIS_URL=url + "/99", COLUMNS="200")
        ran = subprocess.run(
            [SIFT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert "SIFT_REDIS_URL" in said and "DB index is out of range" in said, said
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said


def _late_service(kind: str, tmp_path: Path, env: dict[str, str]) -> Service:
    """``sift worker`` (its default processes), ``sift gateway`` or ``sift up`` (its Redis
    ``SIFT_REDIS_URL``'s) on ``env``, not started yet: each is to start before its Redis
    answers."""
    env = child_env(env, inherit_sift=False)
    if kind == "worker":
        return worker_service(tmp_path / "w", env, processes=None)
    if kind == "up":
        up = sift_command("up", "--port", str(free_port()), "--metrics-port", "0",
                          "--data-dir", str(tmp_path / "up"))  # fmt: skip
        return Service("sift up", up, tmp_path / "up.log", env)
    service, _ = gateway_service(tmp_path / "g", env)
    return service


@pytest.mark.parametrize("kind", ["worker", "gateway"])
def test_it_waits_for_a_redis_not_up_yet(tmp_path: Path, kind: str) -> None:
    """The check of the database refuses only what Redis says: a Redis not answering yet (a
    deployment whose workers or gateways start first) is waited for, as Celery waits for its
    broker, and said so (before the start checks, which need it); then it starts. The gateway
    started at once and checked nothing of the Redis (its version, its policy, its AOF). While
    it waits the gateway is live and not ready: ``/healthz`` 200 (an orchestrator's liveness
    and startup probes pass, where it served nothing and was restarted into a crash loop past
    120 s) and ``/readyz`` 503 naming the wait, until Redis answers and the checks pass."""
    port = free_port()
    env = {"SIFT_REDIS_URL": f"redis://127.0.0.1:{port}/3", "SIFT_WORKER_METRICS_PORT": "0"}
    env["SIFT_DATA_DIR"] = str(tmp_path / "data")
    env["SIFT_API_KEYS"] = json.dumps([ACME_KEY])
    service = _late_service(kind, tmp_path, env)
    assert service.log is not None
    proc = service.start()
    try:
        log = service.log
        waiting = b"waiting: cannot connect to the Redis of SIFT_REDIS_URL"
        wait_until(lambda: waiting in log.read_bytes(), kind, proc, log)
        if kind == "gateway":
            url = f"http://127.0.0.1:{service.port}"
            live = lambda: http_get(url + "/healthz", timeout=1).status_code == 200  # noqa: E731
            wait_until(live, "its /healthz", proc, log)  # uvicorn binds once its app is up
            ready = httpx.get(url + "/readyz", timeout=10)
            assert ready.status_code == 503, ready.text
            assert "waiting for its Redis" in ready.json()["error"]["message"], ready.text
            assert "start checks" in ready.json()["error"]["message"], ready.text
            asked = httpx.get(url + "/v1/batches", headers=ACME, timeout=10)  # nothing taken
            assert asked.status_code == 503, asked.text
            assert "waiting for its Redis" in asked.json()["error"]["message"], asked.text
        with redis_server(tmp_path / "redis", port=port):
            service.wait_ready()
            assert proc.poll() is None
    finally:
        stop(proc, service.stop_timeout)


def test_a_starting_gateway_says_it_stored_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``sift gateway`` waiting for its Redis (a port nobody listens on) stores nothing,
    and its 503 says so by its type, ``starting``, as ``job_store_full``'s does: ``sift index
    delete`` sends its delete job again while the gateway starts, and once its tries end
    says nothing was stored, not that the delete "may have been accepted and run" (what it
    says after a failure that may follow a job made). Its type was ``unavailable``, whose
    write may have been made."""
    env = {"SIFT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "SIFT_WORKER_METRICS_PORT": "0"}
    env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_API_KEYS=json.dumps([ACME_KEY]))
    service = _late_service("gateway", tmp_path, env)
    assert service.log is not None
    log = service.log
    proc = service.start()
    url = f"http://127.0.0.1:{service.port}"
    # its 4 minutes' tries, cut
    monkeypatch.setattr("worker.cli._http.RETRY_SECONDS", 1.5)
    monkeypatch.setattr("worker.cli._http.IDEMPOTENCY_PENDING_TTL_SECONDS", 1.5)
    cli_env = {"SIFT_URL": url, "SIFT_API_KEY": ACME_KEY["key"], "COLUMNS": "200"}
    try:
        live = lambda: http_get(url + "/healthz", timeout=1).status_code == 200  # noqa: E731
        wait_until(live, "its /healthz", proc, log)
        asked = httpx.post(url + "/v1/indexes/demo/documents/delete", json={"ids": ["d1"]},
                           headers=ACME, timeout=10)  # fmt: skip
        ready = httpx.get(url + "/readyz", timeout=10)
        deleted = CliRunner().invoke(app, ["index", "delete", "demo", "--yes"], env=cli_env)
    finally:
        stop(proc, service.stop_timeout)
    assert asked.status_code == 503 and asked.headers["retry-after"] == "1", asked.text
    assert asked.json()["error"]["type"] == "starting", asked.text
    assert "nothing was stored; retry after 1 s" in asked.json()["error"]["message"], asked.text
    assert ready.status_code == 503 and ready.json()["error"]["type"] == "starting", ready.text
    said = " ".join(deleted.output.split())
    assert deleted.exit_code == 1, said
    assert "trying again" in said, said  # sent again while the gateway started
    assert said.endswith("nothing was stored; retry after 1 s"), said
    assert "may have been accepted" not in said, said


@pytest.mark.parametrize("processes", ["2", "1"])
def test_a_worker_serves_its_metrics_while_it_waits_for_redis(
    tmp_path: Path, processes: str
) -> None:
    """``sift worker`` (its supervisor, or one process) serves ``/metrics`` while it waits for
    its Redis, as it did while Celery waited for its broker: deploy/k8s's startupProbe reads
    it, and killed a worker pod that waited longer than its 120 s (a Redis outage, an AOF
    loading) into a crash loop. It served nothing until Redis answered."""
    metrics_port = free_port()
    env = {"SIFT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "SIFT_DATA_DIR": str(tmp_path)}
    env["SIFT_WORKER_METRICS_PORT"] = str(metrics_port)
    env["SIFT_WORKER_PROCESSES"] = processes
    service = _late_service("worker", tmp_path, env)
    assert service.log is not None
    log = service.log
    proc = service.start()
    try:
        wait_until(lambda: b"waiting: cannot connect" in log.read_bytes(), "worker", proc, log)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert metrics.status == 200
        # the Deployment's liveness fails on none running: no count is given until they start
        assert b'sift_worker_processes{state="running"} 0.0' not in metrics.read()
        assert proc.poll() is None and b"waiting: cannot connect" in log.read_bytes()
    finally:
        stop(proc, service.stop_timeout)


@pytest.mark.parametrize(
    ("sig", "code", "word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["ctrl-c", "sigterm"],
)
@pytest.mark.parametrize("kind", ["worker", "gateway", "up"])
def test_a_ctrl_c_while_it_waits_for_redis_says_so(
    tmp_path: Path, kind: str, sig: signal.Signals, code: int, word: str
) -> None:
    """Ctrl-C while ``sift worker``, ``sift gateway`` or ``sift up`` waits for its Redis:
    nothing was started yet (the gateway, live meanwhile, was never ready), and one line says
    so, exit 130 (it ended with no word: ``sift up``'s own Ctrl-C line, "interrupted while
    starting", comes once it starts processes). A SIGTERM is taken as a Ctrl-C, said
    "terminated", exit 143: the gateway's uvicorn stopped and sent itself the signal again,
    whose default killed it with no line (status -15)."""
    env = {"SIFT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "COLUMNS": "200"}
    env.update(SIFT_WORKER_METRICS_PORT="0", SIFT_DATA_DIR=str(tmp_path / "data"))
    service = _late_service(kind, tmp_path, env)
    assert service.log is not None
    log = service.log
    proc = service.start()
    try:
        wait_until(lambda: b"waiting: cannot connect" in log.read_bytes(), kind, proc, log)
        proc.send_signal(sig)
        status = proc.wait(30)
    finally:
        stop(proc, service.stop_timeout)
    said = log.read_text(errors="replace")
    assert status == code, said[-3000:]
    stopped = "the gateway stopped, never ready" if kind == "gateway" else "nothing was started"
    assert f"{word} while waiting for Redis; {stopped}" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
@pytest.mark.parametrize("args", [["worker", "--processes", "1"], ["gateway", "--port"]])
def test_an_evicting_redis_is_one_line_naming_its_policy(
    tmp_path: Path, args: list[str], policy: str
) -> None:
    """A Redis that evicts (``allkeys-lru``, a common managed default; ``volatile-lru``) drops
    accepted jobs, finished results and a live worker's heartbeat when full, and they read
    404: the job store and the broker must keep every key. A worker or gateway started on one
    ran as if nothing were wrong; each now stops at its start, one line naming the setting."""
    if args[-1] == "--port":
        args = [*args, str(free_port())]
    with redis_server(tmp_path / "redis") as url:
        admin = redis.Redis.from_url(url)
        admin.config_set("maxmemory-policy", policy)
        admin.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
        env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0")
        env.update(SIFT_REDIS_URL=url + "/0", COLUMNS="200")
        ran = subprocess.run(
            [SIFT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert f"maxmemory-policy {policy}" in said, said
    assert "maxmemory-policy noeviction" in said and "SIFT_REDIS_URL" in said, said
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said


@contextlib.contextmanager
def _redis_saying_version_6(port: int) -> Iterator[str]:
    """A TCP proxy to the redis-server on ``port`` whose ``INFO`` says ``redis_version:6.``
    (:func:`tests.redis6.proxy_saying_version_6`)."""
    listener = socket.create_server(("127.0.0.1", 0))
    links = proxy_saying_version_6(listener, port)
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for sock in links:
            sock.close()


@pytest.mark.parametrize("args", [["worker", "--processes", "1"], ["gateway", "--port"]])
def test_a_redis_older_than_7_is_one_line_naming_its_version(
    tmp_path: Path, args: list[str]
) -> None:
    """Redis 6 cannot load a script that declares flags (the release of a run's claim, flagged
    ``allow-oom`` so that it runs on a full Redis): a worker on one would start, and fail
    each batch chunk's release. The gateway and the worker stop at their start, one line
    naming the version Redis reports and the one Sift needs."""
    if args[-1] == "--port":
        args = [*args, str(free_port())]
    port = free_port()
    with redis_server(tmp_path / "redis", port=port), _redis_saying_version_6(port) as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
        env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0")
        env.update(SIFT_REDIS_URL=url + "/0", COLUMNS="200")
        ran = subprocess.run(
            [SIFT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert "SIFT_REDIS_URL: Redis 6." in said and "7.0 or later" in said, said
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said


def _without_sift(tmp_path: Path, **more: str) -> dict[str, str]:
    """This environment without its ``SIFT_`` variables, with ``more`` and a data folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_GATEWAY_PORT=str(free_port()),
               SIFT_WORKER_METRICS_PORT="0", SIFT_WORKER_PROCESSES="1", COLUMNS="200",
               **more)  # fmt: skip
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", ["up", "demo"])
def test_its_own_redis_older_than_7_is_one_line_naming_it(tmp_path: Path, command: str) -> None:
    """``sift up`` and ``sift demo`` start a ``redis-server`` of their own: the machine's,
    which a distribution's apt makes Redis 6 (Ubuntu 22.04, Debian 11). Each stops, exit 2,
    one line naming the binary, its version and 7.0. Before, its worker refused the Redis and
    it exited 1 naming SIFT_REDIS_URL, which no one had set ("worker exited early")."""
    real = shutil.which("redis-server")
    assert real is not None
    fake = tmp_path / "bin" / "redis-server"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} {redis6.__file__} {real} "$@"\n')
    fake.chmod(0o755)
    env = _without_sift(tmp_path, PATH=f"{fake.parent}:{os.environ['PATH']}")
    ran = subprocess.run([SIFT, command], env=env, capture_output=True, text=True, timeout=150,
                         check=False)  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    error = [line for line in said.splitlines() if line.startswith("error:")]
    assert len(error) == 1, said
    assert str(fake) in error[0] and "Redis 6." in error[0] and "7.0" in error[0], said
    assert "SIFT_REDIS_URL" not in said and "Traceback" not in said, said


@pytest.mark.timeout(180)
def test_a_process_of_sift_up_that_refuses_its_first_start_stops_it_with_exit_2(
    tmp_path: Path,
) -> None:
    """``sift up`` whose worker refuses to start (exit 2: ``SIFT_WORKER_POOL=prefork`` at the
    threads pool's concurrency) the first time: ``sift up`` stops, exit 2, naming it and
    the worker's error line, as for a refusal after its start. It exited 1, "worker exited
    early (exit status 2)" and the worker's log tail."""
    env = _without_sift(tmp_path, SIFT_WORKER_POOL="prefork")
    ran = subprocess.run([SIFT, "up"], env=env, capture_output=True, text=True, timeout=150,
                         check=False)  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert "worker refused to start (SIFT_WORKER_POOL=prefork" in said, said
    assert "every process stopped" in said and "Traceback" not in said, said


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        (None, "SIFT_API_KEYS_FILE"),  # the file is not there
        ('[{"key": "short", "tenant": "t", "webhook_secret": "whsec_c2VjcmV0"}]',
         "entry 0, field key"),
        (json.dumps([{"key_sha256": "0" * 64, "tenant": "acme", "webhook_secret": _OLD}]),
         "set SIFT_API_KEY"),  # only digests: no key the stack could call its gateway with
    ],
)  # fmt: skip
def test_sift_up_with_keys_it_cannot_use_is_a_usage_error_and_starts_nothing(
    tmp_path: Path, keys: str | None, named: str
) -> None:
    """``SIFT_API_KEYS_FILE`` is a setting: one ``sift up`` cannot use stops it, exit 2,
    naming it, before anything starts, as ``sift gateway`` and ``sift worker`` stop and as
    ``sift up`` stops on every other bad setting. It exited 1, the status of what failed,
    after it had claimed the data folder and made its sub-folders."""
    path = tmp_path / "keys.json"
    if keys is not None:
        path.write_text(keys)
    env = _without_sift(tmp_path, SIFT_API_KEYS_FILE=str(path))
    ran = subprocess.run([SIFT, "up"], env=env, capture_output=True, text=True, timeout=60,
                         check=False)  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert said.startswith("error:") and named in said and "Traceback" not in said, said
    assert len(said.strip().splitlines()) == 1, said
    assert _OLD not in said, said  # no secret quoted
    assert not (tmp_path / "data").exists()  # nothing started, nothing made


def test_an_evicting_policy_without_a_maxmemory_is_warned_of_not_refused(tmp_path: Path) -> None:
    """``allkeys-lru`` with ``maxmemory 0`` (Redis's default: no limit) evicts nothing, so it
    loses no job: the gateway and the worker start, and each says once that a ``maxmemory``
    set later with that policy would. Both were refused (exit 2) as if Redis evicted."""
    with redis_server(tmp_path / "redis") as url:
        admin = redis.Redis.from_url(url)
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.close()
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_WORKER_METRICS_PORT": "0", "COLUMNS": "200"}
        env["SIFT_DATA_DIR"] = str(tmp_path / "data")
        with gateway_process(tmp_path / "g", child_env(env, inherit_sift=False)):
            service = worker_service(tmp_path / "w", child_env(env, inherit_sift=False))
            assert service.log is not None
            proc = service.start()
            try:
                service.wait_ready()
            finally:
                stop(proc, service.stop_timeout)
        for log in [service.log, tmp_path / "g" / "gateway.log"]:
            said = log.read_text(errors="replace")
            assert said.count("maxmemory-policy allkeys-lru") == 1, (log.name, said[-3000:])
            assert "maxmemory 0" in said and "noeviction" in said, (log.name, said[-3000:])


def test_a_redis_that_keeps_every_key_starts_a_worker_and_a_gateway(tmp_path: Path) -> None:
    """The same start on ``noeviction`` (``sift up``'s, the compose file's): both run."""
    with redis_server(tmp_path / "redis") as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_WORKER_METRICS_PORT": "0"}
        env["SIFT_DATA_DIR"] = str(tmp_path / "data")
        with gateway_process(tmp_path / "g", child_env(env, inherit_sift=False)):
            service = worker_service(tmp_path / "w", child_env(env, inherit_sift=False))
            proc = service.start()
            try:
                service.wait_ready()
                assert proc.poll() is None
            finally:
                stop(proc, service.stop_timeout)


@pytest.mark.parametrize("appendonly", [False, True])
def test_a_redis_without_its_aof_is_warned_of_at_start(tmp_path: Path, appendonly: bool) -> None:
    """A Redis that keeps no AOF (``appendonly no``; with ``save ""`` nothing at all) loses
    every job and message at its restart: the gateway and the worker start (a dev Redis may run
    so) but each says so once, at WARNING, naming what to set. They said nothing."""
    with redis_server(tmp_path / "redis", appendonly=appendonly) as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_WORKER_METRICS_PORT": "0"}
        env["SIFT_DATA_DIR"] = str(tmp_path / "data")
        with gateway_process(tmp_path / "g", child_env(env, inherit_sift=False)):
            service = worker_service(tmp_path / "w", child_env(env, inherit_sift=False))
            assert service.log is not None
            proc = service.start()
            try:
                service.wait_ready()
            finally:
                stop(proc, service.stop_timeout)
            logs = [service.log, tmp_path / "g" / "gateway.log"]
            for log in logs:
                said = log.read_text(errors="replace")
                warned = said.count("appendonly yes")
                assert warned == (0 if appendonly else 1), (log.name, said[-3000:])
                if not appendonly:
                    assert "a restart of it loses every job" in said, said[-3000:]


@pytest.mark.parametrize("args", [["worker", "--processes", "1"], ["worker", "--processes", "2"]])
def test_a_user_without_pub_sub_channels_is_one_line_naming_them(
    tmp_path: Path, args: list[str]
) -> None:
    """An ACL user with every key and command but no channel (``~* +@all`` without ``&*``:
    Redis 7's ``acl-pubsub-default`` is ``resetchannels``): Celery's remote control subscribes
    to its pidbox channel, and each worker process died on the refusal ("Unrecoverable
    error", exit 0) and was started again for good while the gateway took jobs. ``sift
    worker`` now stops at its start, one line naming the channels and ``&*``."""
    with redis_server(tmp_path / "redis") as url:
        admin = redis.Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "nochannels", "on", ">pw", "~*", "+@all")
        admin.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
        env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_WORKER_METRICS_PORT="0")
        host = url.removeprefix("redis://")
        env.update(SIFT_REDIS_URL=f"redis://nochannels:pw@{host}/0", COLUMNS="200")
        ran = subprocess.run(
            [SIFT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert "SIFT_REDIS_URL" in said and "&*" in said and "channel" in said, said
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said


_CHANNELS = ["~*", "&*", "+@all"]  # every key, channel and command
_EVICTING = ("maxmemory-policy", "allkeys-lru")


@pytest.mark.parametrize(
    ("kind", "user", "config", "named"),
    [
        pytest.param(
            "worker", ["~*", "+@all"], ("maxmemory-policy", "noeviction"), "&*", id="no-channels"
        ),
        pytest.param("worker", _CHANNELS, _EVICTING, "maxmemory-policy", id="evicting"),
        pytest.param("gateway", _CHANNELS, _EVICTING, "maxmemory-policy", id="gateway-evicting"),
        pytest.param("gateway", _CHANNELS, None, "Redis 6.", id="gateway-redis-6"),
        pytest.param("up", _CHANNELS, _EVICTING, "maxmemory-policy", id="up-evicting"),
    ],
)
def test_a_redis_that_answers_late_gets_the_same_start_checks(
    tmp_path: Path, kind: str, user: list[str], config: tuple[str, str] | None, named: str
) -> None:
    """``sift worker`` (its default processes), ``sift gateway`` or ``sift up`` on a
    ``SIFT_REDIS_URL`` started before its Redis answers (pods starting together, a Redis
    restarting), which then comes up with a user without Pub/Sub channels, evicting, or older
    than 7.0 (``config`` None: a proxy that says 6.): the start checks took "not answering"
    for no refusal and let it start, and never looked again; each worker process died on
    Celery's ``PSUBSCRIBE`` and was restarted for good (the evicting Redis ran on), the
    gateway served on an evicting Redis or one whose scripts it cannot load, and ``sift up``
    started its worker, which waited, then refused (exit 1: "worker exited early"). Each now
    waits for Redis to answer, as Celery waits for its broker, then stops as on a Redis up
    at the start: one line, exit 2. The user is made after Redis is up: the tries meanwhile
    are refused its password, which is waited out too."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        target = port
        if config is None:  # the proxy answers from the start; Redis behind it, late
            proxied = stack.enter_context(_redis_saying_version_6(port))
            target = int(proxied.rsplit(":", 1)[1])
        env = {"SIFT_REDIS_URL": f"redis://sift:pw@127.0.0.1:{target}/0", "COLUMNS": "200"}
        env.update(SIFT_WORKER_METRICS_PORT="0", SIFT_DATA_DIR=str(tmp_path / "data"))
        service = _late_service(kind, tmp_path, env)
        assert service.log is not None
        log = service.log
        proc = service.start()
        try:  # waiting for Redis: Celery's line before, the start check's now
            wait_until(lambda: b"cannot connect to" in log.read_bytes().lower(), kind, proc, log)
            with redis_server(tmp_path / "redis", port=port) as url:
                admin = redis.Redis.from_url(url)
                if config is not None:
                    admin.config_set(*config)
                admin.execute_command("ACL", "SETUSER", "sift", "on", ">pw", *user)
                admin.close()
                try:
                    code = proc.wait(60)  # a worker process starts and dies within 10 s or so
                except subprocess.TimeoutExpired:
                    pytest.fail(log.read_text(errors="replace")[-4000:])
        finally:
            stop(proc, service.stop_timeout)
    said = log.read_text(errors="replace")
    assert code == 2, said[-4000:]
    assert "SIFT_REDIS_URL" in said and named in said, said[-4000:]
    assert "Unrecoverable error" not in said and "restarting" not in said, said[-4000:]
    assert "Traceback" not in said, said[-4000:]


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (``/proc``)."""
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.timeout(180)
def test_a_worker_process_that_refuses_its_restart_stops_its_supervisor(tmp_path: Path) -> None:
    """``sift worker --processes 2`` started on a good API keys file, broken since: a worker
    process killed (the OOM killer, say) is started again and refuses the file (exit 2, one
    line naming it). Its supervisor started it again after each back-off for as long as it
    ran, the refusal unchanged; it now stops the other process and exits 2 naming it."""
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps([{"key": "acme-key-0001", "tenant": "acme", "webhook_secret": _OLD}])
    )
    with redis_server(tmp_path / "redis") as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_WORKER_METRICS_PORT": "0"}
        env.update(SIFT_DATA_DIR=str(tmp_path / "data"), SIFT_API_KEYS_FILE=str(keys))
        service = worker_service(tmp_path / "w", child_env(env, inherit_sift=False), processes=2)
        assert service.log is not None
        proc = service.start()
        try:
            service.wait_ready()
            keys.write_text("[{")  # broken after the start
            [first, *_] = _children(proc.pid)
            os.kill(first, 9)
            code = proc.wait(timeout=120)
        finally:
            stop(proc, service.stop_timeout)
    said = service.log.read_text(errors="replace")
    assert code == 2, said[-3000:]
    assert said.count("restarting it in") == 1, said[-3000:]  # the killed one, once
    assert "refused to start" in said and "SIFT_API_KEYS_FILE" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
