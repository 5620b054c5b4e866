"""Every ``sift worker`` on one Redis serves one embedded data folder: one given another
folder while a worker of the first lives stops at its start, exit 2, one line naming
``SIFT_DATA_DIR`` and the other folder; once the first folder's workers have stopped, it
starts. Before, it started, and each index was split between the two folders, every job
``succeeded`` (20 documents ingested through two such workers: 10 in each folder).

Real processes: a redis-server, ``sift worker``s as an operator runs them.
"""

from __future__ import annotations

import signal
import socket
import sqlite3
import time
from pathlib import Path

import redis

from worker.constants import DATA_FOLDER_HOLDERS_KEY
from worker.processes.stack import (
    Service,
    child_env,
    redis_server,
    running,
    sift_command,
    stop,
    worker_service,
)


def _env(url: str, data_dir: Path) -> dict[str, str]:
    return child_env(
        {"SIFT_REDIS_URL": url + "/0", "SIFT_DATA_DIR": str(data_dir),
         "SIFT_WORKER_METRICS_PORT": "0", "COLUMNS": "300", "NO_COLOR": "1"},
        inherit_sift=False,
    )  # fmt: skip


def _start_or_refusal(tmp: Path, env: dict[str, str], name: str) -> tuple[int | None, str]:
    """``sift worker`` started until it is ready (None) or exits (its status); its output."""
    log = tmp / f"{name}.log"
    service = Service(name, sift_command("worker", "--name", name, "--processes", "1"), log,
                      env, ready_line=b" ready.")  # fmt: skip
    proc = service.start()
    try:
        while proc.poll() is None and b" ready." not in log.read_bytes():
            time.sleep(0.1)  # the test's timeout bounds it
        return proc.poll(), log.read_text()
    finally:
        stop(proc, service.stop_timeout)


def _documents(data_dir: Path) -> int:
    """The documents in ``data_dir``'s ``sift.db`` (none if it has none)."""
    if not (data_dir / "sift.db").exists():
        return 0
    with sqlite3.connect(data_dir / "sift.db") as db:
        return int(db.execute("SELECT count(*) FROM docs").fetchone()[0])


def test_a_worker_of_another_folder_is_refused_while_the_first_folders_live(
    tmp_path: Path,
) -> None:
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    (tmp_path / "link").symlink_to(first)
    with redis_server(tmp_path / "redis") as url:
        with (
            running(worker_service(tmp_path / "w", _env(url, first), "one")),
            # the same folder, by another path and as two processes: both run
            running(
                worker_service(tmp_path / "w", _env(url, tmp_path / "link"), "two", processes=2)
            ),  # fmt: skip
        ):
            holders = redis.Redis.from_url(url, decode_responses=True)
            while len([h for h in holders.zrange(DATA_FOLDER_HOLDERS_KEY, 0, -1)
                       if not h.endswith(":start")]) < 3:  # fmt: skip
                time.sleep(0.1)  # each of the 3 processes holds the folder by its heartbeat
            status, said = _start_or_refusal(tmp_path, _env(url, other), "other")
            assert status == 2, said
            line = [text for text in said.splitlines() if "error:" in text]
            assert len(line) == 1 and "SIFT_DATA_DIR" in line[0], said
            assert f"{socket.gethostname()}:{first.resolve()}" in line[0], said
            assert "Traceback" not in said and " ready." not in said, said
            assert _documents(other) == 0
        # both stopped (SIGTERM): the other folder's worker starts at once
        status, said = _start_or_refusal(tmp_path, _env(url, other), "other-again")
        assert status is None, said


def test_a_worker_killed_is_started_again_on_its_folder_at_once(tmp_path: Path) -> None:
    """``sift up``'s restart after a SIGKILL, and an orchestrator's: the dead worker's hold
    has not lapsed, but it holds the same folder."""
    with redis_server(tmp_path / "redis") as url:
        service = worker_service(tmp_path / "w", _env(url, tmp_path / "data"), "one")
        with running(service):
            assert service.proc is not None
            service.proc.send_signal(signal.SIGKILL)
            service.proc.wait(10)
        status, said = _start_or_refusal(tmp_path, _env(url, tmp_path / "data"), "again")
        assert status is None, said
