"""``sift status`` with no SIFT_REDIS_URL reads the ``redis-url`` file of the ``sift up`` stack
on SIFT_DATA_DIR. A stack that could not remove it (SIGKILLed, the machine restarted) leaves
the file behind, its lock gone: that is no stack running there, and the error says so.

Before: ``cannot read Redis at the `sift up` stack's (DIR/redis-url): Error 111 connecting to
127.0.0.1:PORT. Connection refused.``, as though a stack ran there with its Redis down.
"""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner, Result

from worker.cli import app
from worker.processes.folder_locks import claim_data_dir


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(data_dir: Path) -> Result:
    env = {"SIFT_REDIS_URL": "", "SIFT_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    return CliRunner().invoke(app, ["status", "--no-inspect"], env=env)


def _left_file(data_dir: Path) -> None:
    data_dir.mkdir()
    (data_dir / "sift-up.lock").write_text("pid 1, gateway port 8080\n")  # no one holds it
    (data_dir / "redis-url").write_text(f"redis://127.0.0.1:{_closed_port()}/0\n")


def test_a_redis_url_file_a_killed_stack_left_is_no_stack_running(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _left_file(data_dir)
    result = _status(data_dir)
    output = " ".join(result.output.split())
    assert result.exit_code == 1, output
    assert f"no `sift up` stack runs on {data_dir}" in output, output
    assert f"{data_dir / 'redis-url'} is left from one that did not stop" in output, output
    assert "SIFT_REDIS_URL" in output and "Traceback" not in output


def test_a_running_stack_whose_redis_does_not_answer_is_said_so(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _left_file(data_dir)
    with claim_data_dir(data_dir, "pid 1, gateway port 8080"):  # the stack runs: it holds it
        result = _status(data_dir)
    output = " ".join(result.output.split())
    assert result.exit_code == 1, output
    assert "cannot read Redis" in output and "Connection refused" in output, output
    assert "no `sift up` stack runs" not in output
